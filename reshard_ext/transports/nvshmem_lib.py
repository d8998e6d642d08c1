"""The NVSHMEM transport, process side: finding libnvshmem_host, the one NVSHMEM world of
the process (bootstrapped from a torch.distributed group with a unique id) and the
symmetric regions plans stage in.

Importing this module needs neither CUDA nor NVSHMEM; `world()` raises ReshardError on
every rank of the group, naming the ranks and what they miss, before anything moves.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import _C, groups
from ..errors import ReshardError
from ..options import set_process_env_default
from . import libfiles

_SONAME = "libnvshmem_host.so.3"
_WORLD: tuple | None = None  # its processes (groups.processes) of the NVSHMEM world, in PE order


def available() -> bool:
    """Whether the extension was built with the NVSHMEM transport (any CUDA build)."""
    return bool(_C._build_info.get("nvshmem")) and hasattr(_C, "NvshmemExchange")


def library_candidates() -> list[str]:
    """Where libnvshmem_host may be, after one already in the process: NVSHMEM_HOME, then
    the nvidia-nvshmem wheel beside torch."""
    return libfiles.library_files("NVSHMEM_HOME", "nvidia.nvshmem", _SONAME)


def load_library() -> str:
    """Loads libnvshmem_host (once) and returns its file; ReshardError if none."""
    if not available():
        raise ReshardError("reshard_ext was built without CUDA, so without the NVSHMEM transport "
                           "(rx.build_info()['nvshmem'] is False); rebuild with RESHARD_EXT_CUDA=ON "
                           "or use backend='nccl'")
    return str(_C.nvshmem_load(library_candidates()))


def runtime_status() -> str:
    """'<version> (<file>)' of the libnvshmem_host the transport uses, or why there is none."""
    return libfiles.runtime_status(available(), load_library, lambda: ".".join(map(str, _C.nvshmem_version())))


def loaded_library() -> str:
    """The loaded libnvshmem_host file, or '' (loads nothing)."""
    return str(_C.nvshmem_library_path()) if available() else ""


def local_problem() -> str | None:
    """Why this rank cannot run the NVSHMEM transport, or None."""
    if not available():
        return ("reshard_ext was built without CUDA, so without the NVSHMEM transport (rx.build_info()['nvshmem'] "
                "is False)")
    if not torch.cuda.is_available():
        return "backend 'nvshmem' needs CUDA, which torch does not see"
    try:
        load_library()
    except ReshardError as e:
        return str(e)
    if _WORLD is None and _C.nvshmem_initialized():
        return "NVSHMEM was initialised in this process by another library; reshard_ext needs its own world"
    return None


def check_group(group: Any) -> list[Any]:
    """Raises ReshardError on every rank of `group` (collective) when any rank cannot run
    the transport, naming the ranks and what they miss; else returns each rank's world."""
    votes: list[Any] = [None] * groups.size(group)
    dist.all_gather_object(votes, (local_problem(), _WORLD), group=group)
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(votes) if p]
    if problems:
        raise ReshardError("backend 'nvshmem' cannot run on every rank of the group:\n  " + "\n  ".join(problems))
    return [w for _, w in votes]


def world(group: Any, batch_bytes: int = 512 << 20) -> list[int]:
    """Joins (once per process) the NVSHMEM world of `group`'s processes; returns the PE of
    each group rank. Collective over `group`. Every later plan must span the same processes:
    NVSHMEM has one world per process, and its allocations are collective over all of it.
    batch_bytes (a plan's staging bound) sizes the symmetric heap unless the user set it."""
    global _WORLD
    ranks = groups.processes(group)
    each = check_group(group)
    worlds = set(each)
    if worlds != {None}:
        if len(worlds) != 1 or set(next(iter(worlds)) or ()) != set(ranks):
            raise ReshardError(f"backend 'nvshmem': this process's NVSHMEM world is the processes "
                               f"{sorted(_WORLD or ())}, and a plan must span exactly those processes "
                               f"(this group: {sorted(ranks)}; the world of each rank: {each})")
        return [_WORLD.index(g) for g in ranks]  # type: ignore[union-attr]
    # NVLS (multicast objects) is never used: it needs fabric support and reserves memory.
    set_process_env_default("NVSHMEM_DISABLE_NVLS", "1")
    # Room for two plans' double-buffered staging (each rank's region is as big as the
    # largest send plus the largest receive slot of any rank) and the signal words.
    set_process_env_default("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, 8 * batch_bytes + (64 << 20))))
    rank, size = groups.rank(group), groups.size(group)
    box = [_C.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    _C.nvshmem_init(rank, size, box[0], torch.cuda.current_device())
    _WORLD = ranks
    return list(range(size))


# --- symmetric regions ------------------------------------------------------------------
# nvshmem_free is collective, so a plan's region is never freed when the plan is collected
# (ranks collect at different times): it returns to this pool, and a later plan takes a
# region that is free on every rank (agreed in bind) or allocates one, collectively.

_REGIONS: list[list[Any]] = []  # [symmetric address, bytes, in use]


def free_regions() -> list[tuple[int, int]]:
    """(region id, bytes) of this process's unused regions."""
    return [(i, r[1]) for i, r in enumerate(_REGIONS) if not r[2]]


def take_region(votes: list[list[tuple[int, int]]], nbytes: int) -> tuple[int, int]:
    """The smallest region id free on every rank (votes: each rank's free_regions()) with
    at least nbytes, else a new one (collective allocation). Returns (id, address)."""
    common = set.intersection(*(set(v) for v in votes)) if votes else set()
    fitting = sorted(i for i, size in common if size >= nbytes)
    if fitting:
        rid = fitting[0]
    else:
        _REGIONS.append([_C.nvshmem_alloc(nbytes), nbytes, False])
        rid = len(_REGIONS) - 1
    _REGIONS[rid][2] = True
    return rid, int(_REGIONS[rid][0])


def release_region(rid: int) -> None:
    if 0 <= rid < len(_REGIONS):
        _REGIONS[rid][2] = False


__all__ = [
    "available",
    "check_group",
    "library_candidates",
    "load_library",
    "loaded_library",
    "runtime_status",
    "world",
]
