"""PEP 517 build backend: scikit-build-core, plus the NCCL headers a CUDA build needs.

pip builds in an isolated environment that cannot see the user's packages. When the CUDA
parts will be built (nvcc found; RESHARD_EXT_CUDA=ON, or AUTO on a machine with an NVIDIA
driver, as cmake/cuda.cmake decides it; RESHARD_EXT_NCCL not OFF; no NCCL_HOME), this asks
pip for the nvidia-nccl-cu<N> wheel of nvcc's CUDA major, whose nccl.h CMake then finds.
Only the header is used: libnccl is loaded at run time, the one torch already loaded first
(csrc/comm/nccl_loader.cc).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any, Optional

from cuda_driver import driver_found  # tools/, this backend's own folder
from scikit_build_core import build as _skbuild
from scikit_build_core.build import *  # noqa: F401,F403  (the hooks this module does not change)

# The oldest NCCL per CUDA major with everything the transport calls: building against
# the oldest header keeps ncclConfig_t acceptable to every newer libnccl torch may bring.
NCCL_HEADER_WHEELS = {12: "nvidia-nccl-cu12==2.21.5", 13: "nvidia-nccl-cu13==2.27.7"}


def _option(name: str, config_settings: Optional[dict[str, Any]]) -> str:
    value = (config_settings or {}).get(f"cmake.define.{name}") or os.environ.get(name) or "AUTO"
    return str(value).upper()


def _nvcc() -> Optional[str]:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _cuda_major(nvcc: str) -> Optional[int]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def nccl_requirement(config_settings: Optional[dict[str, Any]] = None) -> list[str]:
    """The NCCL header wheel this build needs, or nothing."""
    if not sys.platform.startswith("linux") or os.environ.get("NCCL_HOME"):
        return []
    cuda = _option("RESHARD_EXT_CUDA", config_settings)
    if cuda == "OFF" or _option("RESHARD_EXT_NCCL", config_settings) == "OFF":
        return []
    if cuda == "AUTO" and not driver_found()[0]:
        return []
    nvcc = _nvcc()
    major = _cuda_major(nvcc) if nvcc else None
    wheel = NCCL_HEADER_WHEELS.get(major) if major else None
    return [wheel] if wheel else []


def get_requires_for_build_wheel(config_settings: Optional[dict[str, Any]] = None) -> list[str]:
    return list(_skbuild.get_requires_for_build_wheel(config_settings)) + nccl_requirement(config_settings)


def get_requires_for_build_editable(config_settings: Optional[dict[str, Any]] = None) -> list[str]:
    return list(_skbuild.get_requires_for_build_editable(config_settings)) + nccl_requirement(config_settings)
