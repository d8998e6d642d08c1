"""Planning (DESIGN sections 2 and 4): validation, metadata exchange, the C++ planner.

`plan` is collective over the group and makes three small all-gathers at most:
  1. metadata: each rank encodes only the layouts it *reports* (one rank of each
     tensor's mesh, `reporter_of`), so the bytes exchanged are O(number of tensors),
     not O(tensors x ranks); local input errors travel along.
  2. agreement: late errors (a rank disagreeing with the reported layout, a rank of a
     mesh that passed no piece), the batch count each rank wants, and two 64-bit plan
     digests whose sums must match (every send has its receive).
  3. only on a digest mismatch: per-pair digests, to name the pairs.
Any error is raised as ReshardError on every rank after the same round, before any
data moves, so no rank is left waiting in a collective the others skipped.
"""
from __future__ import annotations

import contextlib
import gc
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from . import _C
from .errors import ReshardError
from .layout import Layout
from .options import Options
from .transforms import Piece

# Counters for tests and diagnostics: collective metadata exchanges, planner runs and
# warm swaps that reused a model description (swap.py).
STATS: dict[str, int] = {"exchanges": 0, "plans": 0, "describe_reused": 0}

Entries = Mapping[str, tuple[Any, Layout]]
_MAX_LISTED_ERRORS = 20


@dataclass(frozen=True)
class TransferOp:
    """One box moved between this rank and `peer` (== this rank for a local copy)."""

    name: str
    peer: int
    my_box: tuple[slice, ...]
    peer_box: tuple[slice, ...]
    nbytes: int


@dataclass
class RankPlan:
    """The ops of one rank, as the pure planner computes them (`local_plan`)."""

    rank: int
    sends: list[TransferOp]
    recvs: list[TransferOp]
    num_batches: int
    _c: Any = None


def _table(layouts: Mapping[str, Layout]) -> "_C.LayoutTable":
    return _C.LayoutTable([(name, layout._c) for name, layout in layouts.items()])


def _ops(table: "_C.LayoutTable", raw: list, as_sender_copy: bool = False) -> list[TransferOp]:
    out = []
    for dst_name, peer, mine, size, theirs, _glob, nbytes, *_ in raw:
        a = tuple(slice(s, s + n) for s, n in zip(mine, size))
        b = tuple(slice(s, s + n) for s, n in zip(theirs, size))
        if as_sender_copy:  # a copy is stored receiver-side: mine = dst box
            a, b = b, a
        out.append(TransferOp(table.name(dst_name), peer, a, b, nbytes))
    return out


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while many small objects are made: each collection
    re-walks every live object of the caller (half of local_plan's time for 16,000 ops
    with a 45,000-tensor model's layouts alive)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _raise(errors: list[str]) -> None:
    shown = errors[:_MAX_LISTED_ERRORS]
    more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
    raise ReshardError("reshard plan rejected:\n  " + "\n  ".join(shown) + more)


@_collector_paused()
def local_plan(
    src_layouts: Mapping[str, Layout],
    dst_layouts: Mapping[str, Layout],
    rank: int,
    max_batch_bytes: Optional[int] = None,
    num_batches: Optional[int] = None,
    options: Optional[Options] = None,
) -> RankPlan:
    """This rank's ops, from the layouts alone: no process group, no tensors.

    Same-rank copies appear in both lists with peer == rank. `num_batches` defaults to
    what this rank alone needs under `max_batch_bytes`; `plan` agrees on it globally.
    """
    src_t, dst_t = _table(src_layouts), _table(dst_layouts)
    errors = _C.check_tables(src_t, dst_t, 0)
    if errors:
        _raise(errors)
    c = _C.plan_rank(src_t, dst_t, rank, int(max_batch_bytes or 0))
    c.taper = (options or Options()).resolved_batch_taper()
    c.assign_batches(int(num_batches or c.wanted_batches()))
    copies = c.copies()
    return RankPlan(
        rank=rank,
        sends=_ops(dst_t, c.sends()) + _ops(dst_t, copies, as_sender_copy=True),
        recvs=_ops(dst_t, c.recvs()) + _ops(dst_t, copies),
        num_batches=c.num_batches,
        _c=c,
    )


# --- collective planning --------------------------------------------------------------


def _device_kind(entries: list[Entries]) -> Optional[str]:
    kinds = {t.device.type for e in entries for t, _ in e.values() if isinstance(t, (torch.Tensor, Piece))}
    if len(kinds) > 1:
        return "mixed:" + ",".join(sorted(kinds))
    return kinds.pop() if kinds else None


def _check_local(side: str, entries: Entries, rank: int, world: Optional[int] = None) -> list[str]:
    """Checks of this rank's own pieces against their layouts (and, given the group size,
    of their meshes against the group)."""
    errors = []
    for name, item in entries.items():
        if not (isinstance(item, tuple) and len(item) == 2):
            errors.append(f"{side} tensor '{name}' on rank {rank}: expected (tensor, layout), got {type(item).__name__}")
            continue
        tensor, layout = item
        if not isinstance(layout, Layout):
            errors.append(f"{side} tensor '{name}' on rank {rank}: layout is {type(layout).__name__}, not rx.Layout")
            continue
        if not isinstance(tensor, (torch.Tensor, Piece)):
            errors.append(f"{side} tensor '{name}' on rank {rank}: got {type(tensor).__name__}, not a torch.Tensor")
            continue
        outside = sorted({r for r in layout.mesh.ranks if r < 0 or r >= world}) if world is not None else []
        if outside:
            errors.append(f"{side} tensor '{name}': its mesh names ranks {outside[:8]} outside the process group "
                          f"(group ranks are 0..{world - 1}; meshes hold ranks of the group passed to rx.plan)")
            continue
        if rank not in layout.mesh:
            errors.append(f"{side} tensor '{name}': rank {rank} passed a piece but is not in its mesh {layout.mesh}")
            continue
        if layout.error:
            continue  # reported once, by everyone, from the global tables
        want = layout.local_shape(rank)
        if tuple(tensor.shape) != want:
            errors.append(
                f"{side} tensor '{name}' on rank {rank}: local shape {tuple(tensor.shape)} does not match "
                f"the layout's local shape {want}"
            )
        if tensor.dtype != layout.dtype:
            errors.append(f"{side} tensor '{name}' on rank {rank}: dtype {tensor.dtype} but the layout says {layout.dtype}")
        if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
            errors.append(
                f"{side} tensor '{name}' on rank {rank}: on {tensor.device}, not the current device "
                f"cuda:{torch.cuda.current_device()}"
            )
    return errors


def reporter_of(name: str, layout: Layout) -> int:
    """The one rank that reports `name`'s layout: spread over the mesh by a stable hash
    of the name, so every rank's metadata blob is about the same size (all_gather_object
    pads every blob to the largest one)."""
    ranks = layout.mesh.ranks
    return ranks[zlib.crc32(name.encode()) % len(ranks)]


def _check_against_global(side: int, entries: Entries, table: "_C.LayoutTable", rank: int) -> list[str]:
    """A rank's own layouts against the reported ones, and pieces it should have passed."""
    label = ("src", "dst")[side]
    errors = []
    for name, (_, layout) in entries.items():
        i = table.find(name)
        if i < 0:
            errors.append(
                f"{label} tensor '{name}': rank {reporter_of(name, layout)}, which reports its layout, "
                f"passed no piece of it (rank {rank} did)"
            )
        elif not table.layout(i).same_as(layout._c):
            errors.append(
                f"{label} tensor '{name}': rank {rank} has layout {layout!r} but rank "
                f"{reporter_of(name, layout)} reported {table.layout(i).describe()}"
            )
    held = set(entries)
    for name in table.held_by(rank):
        if name not in held:
            errors.append(f"{label} tensor '{name}': rank {rank} is in its mesh but passed no piece of it")
    return errors


@dataclass
class Agreement:
    """What every rank agrees on after planning."""

    src_table: Any
    dst_table: Any
    rank_plan: Any
    device: Optional[str]
    register: bool = False  # every rank voted for NCCL buffer registration
    relay: bool = False  # every rank passed relay on (rx.Options.relay; a disagreement is an error)


def plan_collective(
    src: Entries, dst: Entries, group: Any, max_batch_bytes: Optional[int], errors: Optional[list[str]] = None,
    options: Optional[Options] = None,
) -> Agreement:
    options = options or Options()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    errors = list(errors or []) + _check_local("src", src, rank, world) + _check_local("dst", dst, rank, world)
    device = _device_kind([src, dst])
    report = []
    if not errors:
        for side, entries in ((0, src), (1, dst)):
            for name, (_, layout) in entries.items():
                if reporter_of(name, layout) == rank:
                    report.append((side, name, layout._c))
    payload = (_C.encode_entries(report), errors, device, _registration_vote(device, options), options.resolved_relay())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, payload, group=group)
    STATS["exchanges"] += 1

    errors = [e for _, errs, *_ in gathered for e in errs]
    devices = {d for _, _, d, *_ in gathered if d is not None}
    register = all(g[3] for g in gathered)
    relay = [g[4] for g in gathered]
    if len(set(relay)) > 1:
        errors.append(f"rx.Options(relay=...) / RESHARD_EXT_RELAY must be alike on every rank: on for ranks "
                      f"{[r for r, v in enumerate(relay) if v][:8]}, off for {[r for r, v in enumerate(relay) if not v][:8]}")
    if len(devices) > 1:
        errors.append(f"ranks hold tensors on different devices: {sorted(devices)}")
    if errors:
        _raise(errors)
    decoded = _C.decode_entries([blob for blob, *_ in gathered])
    try:
        src_t = _C.LayoutTable([(n, l) for s, n, l in decoded if s == 0])
        dst_t = _C.LayoutTable([(n, l) for s, n, l in decoded if s == 1])
    except ReshardError as e:  # two reporters disagree: every rank sees the same blobs
        _raise([str(e)])
    errors = list(_C.check_tables(src_t, dst_t, world))
    if errors:
        _raise(errors)

    if max_batch_bytes is None and "cuda" in devices:
        max_batch_bytes = options.resolved_batch_bytes()  # pipelined batches by default on GPUs
    late = _check_against_global(0, src, src_t, rank) + _check_against_global(1, dst, dst_t, rank)
    rank_plan = None
    if not late:
        try:
            rank_plan = _C.plan_rank(src_t, dst_t, rank, int(max_batch_bytes or 0))
            # every rank must taper alike, or the digests below disagree
            rank_plan.taper = options.resolved_batch_taper()
            STATS["plans"] += 1
        except ReshardError as e:
            late.append(f"rank {rank}: {e}")
    mine = (
        late,
        rank_plan.wanted_batches() if rank_plan else 1,
        rank_plan.send_digest if rank_plan else 0,
        rank_plan.recv_digest if rank_plan else 0,
    )
    gathered = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    errors = [e for errs, *_ in gathered for e in errs]
    if errors:
        _raise(errors)
    if sum(s for _, _, s, _ in gathered) % 2**64 != sum(r for _, _, _, r in gathered) % 2**64:
        _raise(_digest_mismatch(rank_plan, group, world))
    rank_plan.assign_batches(max(k for _, k, _, _ in gathered))
    return Agreement(src_t, dst_t, rank_plan, devices.pop() if devices else None, register, all(relay))


def _registration_vote(device: Optional[str], options: Options) -> bool:
    """Votes on NCCL buffer registration (GPU transports only; a rank without tensors
    moves nothing and does not object)."""
    if device not in (None, "cuda") or not _C._build_info["nccl"]:
        return False
    from .transports.cuda import registration_vote

    return registration_vote(options)


def first_failed_rank(group: Any, failed: bool) -> int:
    """One all-reduce: the lowest group rank that passed failed=True, or -1. Lets a
    failure on one rank (an allocation, a local check) raise on every rank at once
    instead of leaving the others waiting in their next collective."""
    g = group if group is not None else dist.group.WORLD
    nccl = dist.get_backend(g) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    world = dist.get_world_size(g)
    t = torch.tensor([world - dist.get_rank(g) if failed else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    top = int(t.item())
    return world - top if top else -1


def _digest_mismatch(rank_plan: Any, group: Any, world: int) -> list[str]:
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, rank_plan.digests(), group=group)
    sent: dict[tuple[int, int], tuple] = {}
    got: dict[tuple[int, int], tuple] = {}
    for r, digests in enumerate(per_rank):
        for frm, to, count, nbytes, h in digests:
            (sent if frm == r else got)[(frm, to)] = (count, nbytes, h)
    errors = []
    for pair in sorted(set(sent) | set(got)):
        if sent.get(pair) != got.get(pair):
            errors.append(
                f"plan mismatch between sender rank {pair[0]} and receiver rank {pair[1]}: "
                f"sender has {sent.get(pair)}, receiver has {got.get(pair)} (ops, bytes, hash)"
            )
    return errors or ["plan digests disagree between ranks"]
