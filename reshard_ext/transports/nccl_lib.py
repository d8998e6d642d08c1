"""The NCCL transport, Python side: one communicator per process group and device, and a
check that the extension and torch run the same libnccl.

Importing this module needs neither CUDA nor NCCL; `communicator()` raises ReshardError
with the reason when the transport cannot be used.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .. import _C, groups
from ..errors import ReshardError
from ..options import default_timeout, skip_nccl_check
from . import libfiles

# Set to 1 to run with a libnccl different from torch's (at your own risk).
_SKIP_LIB_CHECK_ENV = "RESHARD_EXT_SKIP_NCCL_CHECK"

Transfer = tuple[int, int, int]  # (peer group rank, device pointer, bytes)

_COMMS: dict[tuple[tuple, int], _C.NcclComm] = {}  # (groups.key, device) -> its communicator
_EPOCHS: dict[tuple[tuple, int], int] = {}
_LIB_CHECKED = False


def available() -> bool:
    """Whether the extension was built with the NCCL transport."""
    return hasattr(_C, "NcclComm")


def library_candidates() -> list[str]:
    """Where libnccl.so.2 may be, after the one already in the process (torch's): NCCL_HOME,
    then the nvidia-nccl wheel beside torch."""
    return libfiles.library_files("NCCL_HOME", "nvidia.nccl", "libnccl.so.2")


def load_library() -> str:
    """Loads libnccl for the transport (once) and returns its file; ReshardError if none."""
    _require_built()
    return str(_C.nccl_load(library_candidates()))


def runtime_status() -> str:
    """'<version> (<file>)' of the libnccl the transport uses, or why there is none."""
    return libfiles.runtime_status(available(), load_library, lambda: _fmt(_C.nccl_version()))


def _require_built() -> None:
    if not available():
        raise ReshardError(
            "reshard_ext was built without the NCCL transport (rx.build_info()['nccl'] is False). "
            "Rebuild with CUDA and NCCL found: RESHARD_EXT_CUDA=ON, and the nvidia-nccl-cu<N> wheel "
            "matching torch's CUDA major installed (or NCCL_HOME set); or use backend='torch'.")


# --- the libnccl check -------------------------------------------------------------------

_NCCL_LIB = re.compile(r"(^|/)libnccl\.so(\.\d+)*$")  # not plugins (libnccl-net.so, ...)


def mapped_nccl_paths(maps_text: str) -> list[str]:
    """The distinct libnccl files in a /proc/<pid>/maps text, in order of appearance."""
    seen: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6:
            path = fields[5].strip()
            if _NCCL_LIB.search(path) and path not in seen:
                seen.append(path)
    return seen


def _fmt(version: Sequence[int]) -> str:
    return ".".join(str(v) for v in version)


def nccl_mismatch(ours_path: str, ours_version: Sequence[int], torch_version: Sequence[int] | None,
                  mapped: Iterable[str]) -> str | None:
    """Why the extension's libnccl and torch's differ, or None when they are the same.

    ours_*: the library the extension loaded; torch_version: torch.cuda.nccl.version()
    (None when torch has no NCCL); mapped: every libnccl file loaded in the process (any
    file other than ours is taken to be torch's; none when torch links NCCL statically).
    """
    ours = os.path.realpath(ours_path) if ours_path else ""
    others = sorted({os.path.realpath(p) for p in mapped} - {ours})
    problems = []
    if torch_version is not None and tuple(torch_version) != tuple(ours_version):
        problems.append(f"torch uses NCCL {_fmt(torch_version)} but reshard_ext loaded NCCL "
                        f"{_fmt(ours_version)} from {ours or '?'}")
    if others:
        problems.append(f"two libnccl files are loaded in this process: reshard_ext's {ours or '?'} "
                        f"and {', '.join(others)} (torch's)")
    if not problems:
        return None
    return ("; ".join(problems) + ". Two NCCLs in one process waste memory and can disagree on "
            "protocols. Fix: install the nvidia-nccl-cu<N> wheel torch depends on (pip show torch, "
            "requires) and rebuild reshard_ext against it, or set NCCL_HOME to torch's NCCL before "
            f"building. Set {_SKIP_LIB_CHECK_ENV}=1 to skip this check.")


def _torch_nccl_version() -> tuple[int, ...] | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # CPU torch, or torch built without NCCL
        return None
    if isinstance(v, int):  # very old torch: one integer code
        v = (v // 1000, (v % 1000) // 100, v % 100) if v < 10000 else (v // 10000, (v % 10000) // 100, v % 100)
    return tuple(v)


def check_nccl_library() -> None:
    """Raises ReshardError unless the extension runs the libnccl torch runs (same file and
    version). Call it once before the first NCCL transfer; communicator() does."""
    global _LIB_CHECKED
    if _LIB_CHECKED or skip_nccl_check():
        return
    load_library()
    try:
        with open("/proc/self/maps") as f:
            mapped = mapped_nccl_paths(f.read())
    except OSError:  # not Linux: only the versions can be compared
        mapped = []
    problem = nccl_mismatch(_C.nccl_library_path(), _C.nccl_version(), _torch_nccl_version(), mapped)
    if problem:
        raise ReshardError(problem)
    _LIB_CHECKED = True


# --- communicators -----------------------------------------------------------------------

def epoch(group: Any = None, key: tuple | None = None) -> int:
    """How many communicators of `group` (on the current device) this process created:
    ranks that created them together agree on it. key: the group's groups.key, where the
    caller has it (an execute asks every time)."""
    if key is None:
        key = groups.key(group)
    return _EPOCHS.get((key, torch.cuda.current_device()), 0)


def communicator(group: Any = None, timeout_s: float | None = None,
                 fresh: bool = False) -> _C.NcclComm:
    """The NCCL communicator of `group` (default WORLD) on the current CUDA device.

    Collective over `group` the first time (and after a failure); cached afterwards by the
    group's ranks and the device, so every plan over the same ranks shares one. Its ranks
    are group ranks. The unique id travels through the group itself, so any backend that
    can broadcast a Python object works (nccl, gloo).

    A communicator that failed is recreated here, collectively: after a transport error
    every rank must come back through communicator() (or clear_communicators()); a rank
    that still holds a healthy cached one would skip the id broadcast the others wait in,
    unless it passes fresh=True (it then replaces its cached one along with the others).
    The id broadcast gives up after RESHARD_EXT_TIMEOUT seconds.
    """
    _require_built()
    if not torch.cuda.is_available():
        raise ReshardError("the NCCL transport needs a CUDA device, and torch.cuda.is_available() is False; "
                           "use backend='torch' on CPU")
    groups.require(group, "the NCCL transport")
    group = groups.resolve(group)
    ranks = groups.ranks(group)
    device = torch.cuda.current_device()
    key = (groups.key(group), device)
    comm = _COMMS.get(key)
    if comm is not None and comm.usable and not fresh:
        return comm
    _COMMS.pop(key, None)
    check_nccl_library()
    timeout = default_timeout("nccl") if timeout_s is None else float(timeout_s)
    rank = groups.rank(group)
    if rank < 0:
        raise ReshardError(f"communicator(): this process is not a member of the group (ranks {list(ranks)})")
    from ..collectives import all_gather_objects

    uid = all_gather_objects(_C.nccl_unique_id() if rank == 0 else None, group, "creating the NCCL communicator")[0]
    comm = _C.NcclComm(rank, len(ranks), uid, device, timeout)
    try:
        comm.wait_ready(timeout)
    except ReshardError as e:
        raise ReshardError(f"{e} (group ranks 0..{len(ranks) - 1} are global ranks {list(ranks)})") from None
    _COMMS[key] = comm
    _EPOCHS[key] = _EPOCHS.get(key, 0) + 1
    return comm


def exchange(comm: _C.NcclComm, sends: Iterable[Transfer], recvs: Iterable[Transfer],
             stream: torch.cuda.Stream | None = None, on_side_stream: bool = True) -> None:
    """One grouped send/recv of byte ranges, ordered after the work already on `stream`
    (default: the current stream), which waits for it. With on_side_stream the transfer
    runs on the communicator's own stream (see side_stream()), so later work on `stream`
    that does not depend on it is not held back by NCCL's kernels."""
    stream = stream if stream is not None else torch.cuda.current_stream()
    comm.exchange(list(sends), list(recvs), stream.cuda_stream, comm.side_stream if on_side_stream else 0)


def side_stream(comm: _C.NcclComm) -> torch.cuda.ExternalStream:
    """The communicator's stream as a torch stream: `t.record_stream(side_stream(comm))`
    for a buffer freed while a transfer may still read or write it."""
    return torch.cuda.ExternalStream(comm.side_stream, device=torch.device("cuda", comm.device))


def _close_group(group: groups.Standalone) -> None:
    """Closes the communicators of a standalone group that closes (on every member)."""
    for key in [k for k in _COMMS if k[0] == group.key]:
        _COMMS.pop(key).close(10.0)


groups.on_close(_close_group)


def clear_communicators(timeout_s: float = 10.0) -> None:
    """Closes every cached communicator (finalize, else abort after timeout_s). Call it on
    every rank; later communicator() calls create fresh ones."""
    comms = list(_COMMS.values())
    _COMMS.clear()
    for comm in comms:
        comm.close(timeout_s)


__all__ = ["available", "communicator", "exchange", "side_stream", "clear_communicators", "check_nccl_library",
           "nccl_mismatch", "mapped_nccl_paths", "load_library", "runtime_status"]
