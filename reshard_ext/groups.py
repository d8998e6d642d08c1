"""The process group of a refit, read in one place.

Every part of reshard_ext asks this module, never torch.distributed directly, for a
group's rank, size, member ranks, backend and store, and posts its point-to-point
messages through it. Two kinds of groups pass through here:

- groups of the default world (torch.distributed's WORLD and its subgroups), read
  through torch.distributed; `None` stands for WORLD everywhere;
- groups outside any world (`Standalone`, made by rx.connect): torch cannot tell their
  rank or members (they are in no world's registry, and a process may have no world at
  all), so this module keeps what it needs of them in a registry keyed by their torch
  ProcessGroup. Their members are numbered 0..size-1 in the group only, so their
  "global" ranks are their group ranks, and their own store keeps reshard_ext's state
  (never the default world's).

Per-group state elsewhere (host channels, NCCL communicators, cached plans) is keyed by
`key(group)` and registers a hook (`on_close`) that drops it when a standalone group
is closed.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import ReshardError


@dataclass(eq=False)
class Standalone:
    """A process group outside the default world, as reshard_ext sees it (rx.connect's
    ConnectedGroup is one). `worlds[c]`: member c's (job, rank in its job's own world),
    where job identifies its torch.distributed world (None: unknown) and a process with
    no world is a world of its own (rank 0)."""

    process_group: Any
    rank: int
    size: int
    store: Any  # reshard_ext's keys of this group (host channel) live here
    key: tuple  # the same on every member; see key()
    worlds: list[tuple[Any, int]] = field(default_factory=list)
    process_ids: tuple = ()  # each member process's identity (host, pid), where known (see processes())
    closed: bool = False

    def from_world(self, world_rank: int) -> int:
        """The group rank of the process of rank `world_rank` in this process's own world
        (the world its model's process groups live in). Raises ReshardError where that
        process did not join the group."""
        job, mine = self.worlds[self.rank] if self.worlds else (None, 0)
        if job is not None:
            hits = [c for c, w in enumerate(self.worlds) if w == (job, world_rank)]
        else:  # jobs unknown: its members are taken to hold consecutive group ranks, in world order
            c = self.rank - mine + world_rank
            hits = [c] if 0 <= c < self.size and self.worlds[c][1] == world_rank else []
        if len(hits) != 1:
            raise ReshardError(
                f"rank {world_rank} of this process's torch.distributed world is not a member of the group made by "
                f"rx.connect (group rank {self.rank} is world rank {mine} here): every rank of a model's world "
                f"must join the group, or pass the model's rank_offset (its group rank minus its world rank)")
        return hits[0]


_STANDALONE: dict[Any, Standalone] = {}  # torch ProcessGroup -> its record (open groups only)
_CLOSED: weakref.WeakSet = weakref.WeakSet()  # torch ProcessGroups of closed standalone groups
_ON_CLOSE: list[Callable[[Standalone], None]] = []
_LOCK = threading.Lock()


def register(group: Standalone) -> None:
    """Makes `group` (and its torch ProcessGroup) known to every helper here."""
    with _LOCK:
        _STANDALONE[group.process_group] = group


def on_close(hook: Callable[[Standalone], None]) -> None:
    """Runs `hook(group)` when a standalone group closes (drop per-group state)."""
    _ON_CLOSE.append(hook)


def release(group: Standalone) -> None:
    """Marks `group` closed, forgets it, and runs the on_close hooks (local)."""
    with _LOCK:
        if group.closed:
            return
        group.closed = True
        _STANDALONE.pop(group.process_group, None)
        _CLOSED.add(group.process_group)
    for hook in list(_ON_CLOSE):
        hook(group)


def standalone(group: Any) -> Standalone | None:
    """`group`'s record where it is a standalone group (or its torch ProcessGroup), else None."""
    if isinstance(group, Standalone):
        return group
    if group is None:
        return None
    if _STANDALONE:
        rec = _STANDALONE.get(group)
        if rec is not None:
            return rec
    if _CLOSED and _is_closed(group):
        raise ReshardError(_CLOSED_MESSAGE)
    return None


def _is_closed(group: Any) -> bool:
    try:
        return group in _CLOSED
    except TypeError:  # not weak-referenceable: no ProcessGroup, so never a closed one
        return False


_CLOSED_MESSAGE = ("the group made by rx.connect was closed (ConnectedGroup.close()); connect again and plan again: "
                   "plans made over a closed group cannot run")


def resolve(group: Any) -> Any:
    """The torch ProcessGroup of `group`: the default group (WORLD) for None, the
    process_group of a standalone group, else `group` itself."""
    if isinstance(group, Standalone):
        if group.closed:
            raise ReshardError(_CLOSED_MESSAGE)
        return group.process_group
    return group if group is not None else dist.group.WORLD


def is_default(group: Any) -> bool:
    """Whether `group` is the default group (None or WORLD): its ranks are global ranks."""
    return group is None or group is dist.group.WORLD


def usable(group: Any = None) -> bool:
    """Whether collectives can run over `group` in this process: an open standalone group,
    or torch.distributed is initialised."""
    rec = standalone(group)
    if rec is not None:
        return not rec.closed
    return dist.is_available() and dist.is_initialized()


def require(group: Any, what: str) -> None:
    """Raises ReshardError, saying why, where `what` cannot run over `group` in this process."""
    rec = standalone(group)
    if rec is not None and rec.closed:
        raise ReshardError(f"{what}: {_CLOSED_MESSAGE}")
    if not usable(group):
        raise ReshardError(f"{what} needs torch.distributed to be initialised (any launcher, any backend), "
                           f"or a group made by rx.connect")


def rank(group: Any = None) -> int:
    """This process's rank in `group`."""
    rec = standalone(group)
    return rec.rank if rec is not None else dist.get_rank(group)


def size(group: Any = None) -> int:
    """How many ranks `group` has."""
    rec = standalone(group)
    return rec.size if rec is not None else dist.get_world_size(group)


def ranks(group: Any = None) -> tuple[int, ...]:
    """The global ranks (default world) of `group`'s members, in group rank order
    (0..size-1 for a standalone group)."""
    rec = standalone(group)
    if rec is not None:
        return tuple(range(rec.size))
    return tuple(dist.get_process_group_ranks(resolve(group)))


def key(group: Any = None) -> tuple:
    """What caches of per-group state (channels, communicators, plans) are keyed by: the
    same on every member, different for different groups (a default-world group: its
    global ranks and torch's name for it, so that two new_group calls over the same ranks
    have channels and communicators of their own; a standalone group: its own key)."""
    rec = standalone(group)
    if rec is not None:
        return rec.key
    g = resolve(group)
    name = getattr(g, "group_name", None) or dist.distributed_c10d._get_process_group_name(g)
    return ranks(g), str(name)


def processes(group: Any = None) -> tuple:
    """Identities of `group`'s member processes in group rank order, comparable between
    groups of one process: global ranks for default-world groups."""
    rec = standalone(group)
    if rec is not None:
        return rec.process_ids or tuple((rec.key, r) for r in range(rec.size))
    return ranks(group)


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of `group`'s member `group_rank` (itself in a standalone group)."""
    if standalone(group) is not None:
        return group_rank
    return dist.get_global_rank(resolve(group), group_rank)


def group_rank(group: Any, global_rank: int) -> int:
    """The rank in `group` of the process of rank `global_rank` in this process's world
    (the identity for the default group; standalone groups: Standalone.from_world)."""
    rec = standalone(group)
    if rec is not None:
        return rec.from_world(global_rank)
    if is_default(group):
        return global_rank
    return dist.get_group_rank(group, global_rank)


def backend(group: Any = None) -> str:
    """The backend name of `group` ("gloo", "nccl", ...); "gloo" for a standalone group
    (its small collectives run on the CPU; CUDA tensors go to its NCCL backend)."""
    if standalone(group) is not None:
        return "gloo"
    return str(dist.get_backend(group))


def collective_device(group: Any = None) -> torch.device:
    """Where the tensors of a small collective over `group` live: the current CUDA device
    for an NCCL group, else the CPU."""
    if backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def store(group: Any = None) -> Any:
    """The key-value store reshard_ext's own state of `group` (host channel) lives in: the
    default world's store, or a standalone group's own."""
    rec = standalone(group)
    return rec.store if rec is not None else dist.distributed_c10d._get_default_store()


class _Op:
    """A point-to-point op of a standalone group (torch's P2POp needs a registered group).
    `.peer` and `.tensor` as on a P2POp; the peer is a group rank (= its global rank)."""

    __slots__ = ("group", "kind", "peer", "tag", "tensor")

    def __init__(self, kind: str, tensor: torch.Tensor, group: Any, peer: int, tag: int):
        self.kind, self.tensor, self.group, self.peer, self.tag = kind, tensor, group, peer, tag


def p2p_op(kind: str, tensor: torch.Tensor, group: Any, peer: int, tag: int = 0) -> Any:
    """A point-to-point op ("send" or "recv") with `group`'s member `peer` (a group rank),
    for `batch_isend_irecv`. Its `.peer` is the peer's global rank."""
    if standalone(group) is not None:
        return _Op(kind, tensor, resolve(group), peer, tag)
    return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, group=group, tag=tag,
                      group_peer=peer)


def batch_isend_irecv(ops: list[Any]) -> list[Any]:
    """Posts every op of `p2p_op` (one group); returns the requests to wait on."""
    if not ops:
        return []
    if not isinstance(ops[0], _Op):
        return dist.batch_isend_irecv(ops)
    pg, device = ops[0].group, ops[0].tensor.device
    # As torch's batch_isend_irecv: one coalesced launch where the device's backend can (NCCL).
    coalesce = pg._get_backend(device).supports_coalescing
    if coalesce:
        pg._start_coalescing(device)
    works = [(pg.send if op.kind == "send" else pg.recv)([op.tensor], op.peer, op.tag) for op in ops]
    return [pg._end_coalescing(device)] if coalesce else works


__all__ = ["Standalone", "register", "release", "on_close", "standalone", "resolve", "is_default", "usable", "require",
           "rank", "size", "ranks", "key", "processes", "global_rank", "group_rank", "backend", "collective_device",
           "store", "p2p_op", "batch_isend_irecv"]
