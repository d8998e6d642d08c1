"""The process group of a refit, read in one place.

Every part of reshard_ext asks this module, never torch.distributed directly, for a
group's rank, size, member ranks, backend and store, and posts its point-to-point
messages through it: so one seam decides how a group is read (a group of the default
world today; groups outside it can be told apart here).

`None` stands for the default group (torch.distributed's WORLD) everywhere.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def resolve(group: Any) -> Any:
    """`group`, or the default group (WORLD) for None."""
    return group if group is not None else dist.group.WORLD


def is_default(group: Any) -> bool:
    """Whether `group` is the default group (None or WORLD): its ranks are global ranks."""
    return group is None or group is dist.group.WORLD


def usable(group: Any = None) -> bool:
    """Whether collectives can run over `group` in this process (torch.distributed is
    initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in `group`."""
    return dist.get_rank(group)


def size(group: Any = None) -> int:
    """How many ranks `group` has."""
    return dist.get_world_size(group)


def ranks(group: Any = None) -> tuple[int, ...]:
    """The global ranks (default world) of `group`'s members, in group rank order."""
    return tuple(dist.get_process_group_ranks(resolve(group)))


def key(group: Any = None) -> tuple:
    """What caches of per-group state (channels, communicators, plans) are keyed by: the
    same on every member, different for groups of different processes."""
    return ranks(group)


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of `group`'s member `group_rank`."""
    return dist.get_global_rank(resolve(group), group_rank)


def group_rank(group: Any, global_rank: int) -> int:
    """`global_rank`'s rank in `group` (the identity for the default group)."""
    if is_default(group):
        return global_rank
    return dist.get_group_rank(group, global_rank)


def backend(group: Any = None) -> str:
    """The backend name of `group` ("gloo", "nccl", ...)."""
    return str(dist.get_backend(group))


def collective_device(group: Any = None) -> torch.device:
    """Where the tensors of a small collective over `group` live: the current CUDA device
    for an NCCL group, else the CPU."""
    if backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def store(group: Any = None) -> Any:
    """The key-value store reshard_ext's own state of `group` (host channel) lives in."""
    return dist.distributed_c10d._get_default_store()


def p2p_op(kind: str, tensor: torch.Tensor, group: Any, peer: int, tag: int = 0) -> Any:
    """A point-to-point op ("send" or "recv") with `group`'s member `peer` (a group rank),
    for `batch_isend_irecv`. Its `.peer` is the peer's global rank."""
    return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=group, tag=tag,
                      group_peer=peer)


def batch_isend_irecv(ops: list[Any]) -> list[Any]:
    """Posts every op of `p2p_op` (one group); returns the requests to wait on."""
    return dist.batch_isend_irecv(ops) if ops else []


__all__ = ["resolve", "is_default", "usable", "rank", "size", "ranks", "key", "global_rank", "group_rank", "backend",
           "collective_device", "store", "p2p_op", "batch_isend_irecv"]
