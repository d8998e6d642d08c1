"""Where a CUDA library the transports load at run time may be (NCCL, NVSHMEM): the one
already in the process comes first and is found by the C++ loader itself."""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from ..errors import ReshardError
from ..options import external_env


def library_files(home_var: str, wheel_package: str, soname: str) -> list[str]:
    """Existing files named `soname` under $home_var/lib[64], then in the `wheel_package`
    wheel's lib/ folder (e.g. nvidia.nccl beside torch)."""
    out = []
    home = external_env(home_var)
    if home:
        out += [os.path.join(home, d, soname) for d in ("lib", "lib64")]
    try:
        spec = importlib.util.find_spec(wheel_package)
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        out.append(os.path.join(root, "lib", soname))
    return [p for p in out if os.path.exists(p)]


def runtime_status(built: bool, load: Callable[[], str], version: Callable[[], str]) -> str:
    """'<version> (<file>)' of the library `load` finds, "not built", or why there is none."""
    if not built:
        return "not built"
    try:
        path = load()
        return f"{version()} ({path})"
    except ReshardError as e:
        return "not found: " + " ".join(str(e).split())
