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
import hashlib
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _C, groups
from .collectives import all_gather_objects, first_failed_rank  # noqa: F401 - first_failed_rank lived here
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


def _table(layouts: Mapping[str, Layout]) -> _C.LayoutTable:
    return _C.LayoutTable([(name, layout._c) for name, layout in layouts.items()])


def _ops(table: _C.LayoutTable, raw: list, as_sender_copy: bool = False) -> list[TransferOp]:
    out = []
    for op in raw:  # _C.PlannedOp
        size = op.size
        a = tuple(slice(s, s + n) for s, n in zip(op.mine_start, size))
        b = tuple(slice(s, s + n) for s, n in zip(op.theirs_start, size))
        if as_sender_copy:  # a copy is stored receiver-side: mine = dst box
            a, b = b, a
        out.append(TransferOp(table.name(op.dst_name), op.peer, a, b, op.nbytes))
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
    max_batch_bytes: int | None = None,
    num_batches: int | None = None,
    options: Options | None = None,
    grains: Mapping[str, int] | None = None,
) -> RankPlan:
    """This rank's ops, from the layouts alone: no process group, no tensors.

    Same-rank copies appear in both lists with peer == rank. `num_batches` defaults to
    the fewest batches whose staging (largest send batch + largest receive batch) fits
    in `max_batch_bytes`; `plan` agrees on it globally. `grains`: dst name -> the cut
    grain of its last dim (Transform.last_dim_grain); the others are cut plainly.
    """
    problem = batch_bytes_error(max_batch_bytes)
    if problem:
        raise ReshardError(problem)
    src_t, dst_t = _table(src_layouts), _table(dst_layouts)
    errors = _C.check_tables(src_t, dst_t, 0)
    if errors:
        _raise(errors)
    options = options or Options()
    by_index = _grains(dst_t, (grains or {}).get)
    if num_batches:
        c, _ = _plan_rank(src_t, dst_t, rank, None, 1, 256, options, int(max_batch_bytes or 0), grains=by_index)
    else:
        c, num_batches = _plan_rank(src_t, dst_t, rank, max_batch_bytes, 1, 256, options,
                                    fineness=2 if max_batch_bytes else 1, grains=by_index)
        if num_batches == 0:
            raise ReshardError(_too_small(rank, max_batch_bytes, c))
    c.assign_batches(int(num_batches))
    copies = c.copies()
    return RankPlan(
        rank=rank,
        sends=_ops(dst_t, c.sends()) + _ops(dst_t, copies, as_sender_copy=True),
        recvs=_ops(dst_t, c.recvs()) + _ops(dst_t, copies),
        num_batches=c.num_batches,
        _c=c,
    )


def batch_bytes_error(max_batch_bytes: Any) -> str:
    """Why `max_batch_bytes` is invalid, or ""."""
    if max_batch_bytes is None:
        return ""
    if isinstance(max_batch_bytes, bool) or not isinstance(max_batch_bytes, int) or max_batch_bytes < 1:
        return f"max_batch_bytes must be None or a positive integer, got {max_batch_bytes!r}"
    if max_batch_bytes >= 1 << 63:
        return f"max_batch_bytes {max_batch_bytes} does not fit a 64-bit integer"
    return ""


def _grains(dst_t: Any, grain_of: Callable[[str], int | None] | None) -> dict[int, int]:
    """{dst table index: cut grain} of the tensors `grain_of` names a grain for."""
    if grain_of is None:
        return {}
    grains = {i: g for i in range(len(dst_t)) if (g := grain_of(dst_t.name(i))) is not None}
    for i, g in grains.items():
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ReshardError(f"tensor '{dst_t.name(i)}': the cut grain of its last dim must be a positive int, "
                               f"got {g!r}")
    return grains


def _plan_rank(src_t: Any, dst_t: Any, rank: int, limit: int | None, buffers: int, region_align: int,
               options: Options, soft_batch_bytes: int = 0, fineness: int = 1,
               grains: dict[int, int] | None = None) -> tuple[Any, int]:
    """The C++ planner for one rank, and how many batches it wants: the fewest whose
    staging (`buffers` x (largest send + largest receive batch)) fits `limit`, a hard
    bound (0: none does); without a limit, about `soft_batch_bytes` each way per batch.
    `grains`: {dst table index: cut grain of its last dim} (a codec's, _grains)."""
    # Ops start no bigger than a quarter of the budget of one staging copy, so that a
    # few batches can fit; assign_batches cuts them further where a pair needs it.
    per_op = max(1, limit // (4 * buffers)) if limit else soft_batch_bytes
    c = _C.plan_rank(src_t, dst_t, rank, int(per_op), grains or {})
    c.taper = options.resolved_batch_taper()
    c.region_align = region_align
    c.fineness = fineness
    return c, (c.batches_within(limit, buffers) if limit else c.wanted_batches())


def _too_small(rank: int, limit: Any, c: Any) -> str:
    return (f"rank {rank}: max_batch_bytes={limit} is too small for its {c.send_total()} bytes sent and "
            f"{c.recv_total()} received: no batch count keeps its staging (largest send batch + largest receive "
            f"batch) within it, since ops are not cut below one row (or 32 elements of it; a codec tensor's block) "
            f"and every peer's region of a batch is aligned; raise max_batch_bytes")


# --- collective planning --------------------------------------------------------------


def _device_kind(entries: list[Entries]) -> str | None:
    kinds = {t.device.type for e in entries for t, _ in e.values() if isinstance(t, (torch.Tensor, Piece))}
    if len(kinds) > 1:
        return "mixed:" + ",".join(sorted(kinds))
    return kinds.pop() if kinds else None


def _check_local(side: str, entries: Entries, rank: int, world: int | None = None) -> list[str]:
    """Checks of this rank's own pieces against their layouts (and, given the group size,
    of their meshes against the group)."""
    errors = []
    for name, item in entries.items():
        if not isinstance(name, str):
            errors.append(f"{side} tensor {name!r} on rank {rank}: names must be str, got {type(name).__name__}")
            continue
        if not (isinstance(item, tuple) and len(item) == 2):
            errors.append(f"{side} tensor '{name}' on rank {rank}: expected (tensor, layout), "
                          f"got {type(item).__name__}")
            continue
        tensor, layout = item
        if not isinstance(layout, Layout):
            errors.append(f"{side} tensor '{name}' on rank {rank}: layout is {type(layout).__name__}, not rx.Layout")
            continue
        if not isinstance(tensor, (torch.Tensor, Piece)):
            errors.append(f"{side} tensor '{name}' on rank {rank}: got {type(tensor).__name__}, not a torch.Tensor")
            continue
        outside = sorted({r for r in layout.mesh.ranks if r < 0 or r >= world}) if world is not None else []
        if outside and world is not None:
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
            errors.append(f"{side} tensor '{name}' on rank {rank}: dtype {tensor.dtype} "
                          f"but the layout says {layout.dtype}")
        if tensor.device.type not in ("cpu", "cuda"):
            errors.append(f"{side} tensor '{name}' on rank {rank}: on device {tensor.device}; reshard_ext moves CPU "
                          f"and CUDA tensors, whose memory it reads and writes")
            continue
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


def _check_against_global(side: int, entries: Entries, table: _C.LayoutTable, rank: int) -> list[str]:
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
    device: str | None
    register: bool = False  # every rank voted for NCCL buffer registration
    relay: bool = False  # every rank passed relay on (rx.Options.relay; a disagreement is an error)
    plan_id: int = 0  # the same on every rank, different for every rx.plan call
    moves: bool = True  # some rank sends to another (else a verified execute has nothing to check)
    host_ring: bool = False  # every rank voted for the CPU transport's shared-memory rings


def plan_collective(
    src: Entries, dst: Entries, group: Any, max_batch_bytes: int | None, errors: list[str] | None = None,
    options: Options | None = None,
    staging_depth: Callable[[str | None], int] = lambda device: 1,
    grain_of: Callable[[str], int | None] | None = None,
) -> Agreement:
    """The collective part of rx.plan. staging_depth(device): how many staging copies
    of a batch the transport keeps (its pipelining depth), for the max_batch_bytes bound.
    grain_of(dst name): the cut grain of its last dim, or None (Transform.last_dim_grain)."""
    options = options or Options()
    timeout_s = options.resolved_timeout("gloo")
    rank, world = groups.rank(group), groups.size(group)
    errors = list(errors or []) + _check_local("src", src, rank, world) + _check_local("dst", dst, rank, world)
    device = _device_kind([src, dst])
    report = []
    if not errors:
        for side, entries in ((0, src), (1, dst)):
            for name, (_, layout) in entries.items():
                if reporter_of(name, layout) == rank:
                    report.append((side, name, layout._c))
    direct_bytes = (options.resolved_direct_bytes("cpu"), options.resolved_direct_bytes("cuda"))
    payload = (_C.encode_entries(report), errors, device, _registration_vote(device, options), options.resolved_relay(),
               max_batch_bytes is not None, direct_bytes, options.resolved_host_ring())
    gathered = all_gather_objects(payload, group, "rx.plan (metadata exchange)", timeout_s)
    STATS["exchanges"] += 1

    errors = [e for _, errs, *_ in gathered for e in errs]
    devices = {d for _, _, d, *_ in gathered if d is not None}
    register = all(g[3] for g in gathered)
    host_ring = all(g[7] for g in gathered)
    relay = [g[4] for g in gathered]
    if len(set(relay)) > 1:
        errors.append(f"rx.Options(relay=...) / RESHARD_EXT_RELAY must be alike on every rank: on for ranks "
                      f"{[r for r, v in enumerate(relay) if v][:8]}, "
                      f"off for {[r for r, v in enumerate(relay) if not v][:8]}")
    # Any rank bounding its staging cuts its pairs' ops finer, so both ends must.
    fineness = 2 if any(g[5] for g in gathered) else 1
    if len(devices) > 1:
        errors.append(f"ranks hold tensors on different devices: {sorted(devices)}")
    # Both ends of a pair cut their messages by it (ExecTables::bind): apart, they post different sizes.
    direct = [g[6][1 if devices == {"cuda"} else 0] for g in gathered]
    if len(set(direct)) > 1:
        by_value = {v: [r for r, x in enumerate(direct) if x == v][:8] for v in sorted(set(direct))}
        errors.append(f"rx.Tuning(direct_bytes=...) / RESHARD_EXT_{'CUDA' if devices == {'cuda'} else 'CPU'}"
                      f"_DIRECT_BYTES must be alike on every rank, got {by_value} (value: ranks)")
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

    agreed_device = next(iter(devices)) if devices else None
    soft = 0
    if max_batch_bytes is None and agreed_device == "cuda":
        soft = options.resolved_batch_bytes()  # pipelined batches by default on GPUs
    late = _check_against_global(0, src, src_t, rank) + _check_against_global(1, dst, dst_t, rank)
    rank_plan, wanted, fitting = None, 1, None
    grains: dict[int, int] = {}
    try:
        grains = _grains(dst_t, grain_of)
    except Exception as e:  # noqa: BLE001 - a transform failing on this rank alone: agreed on below
        late.append(f"rank {rank}: the transform's last_dim_grain failed: {e!r}")
    if not late:
        try:
            # CPU staging needs no more than the ops' own 16-byte alignment per region;
            # every rank must taper alike, or the digests below disagree.
            depth = staging_depth(agreed_device)
            rank_plan, wanted = _plan_rank(src_t, dst_t, rank, max_batch_bytes, depth,
                                           16 if agreed_device == "cpu" else 256, options, soft, fineness, grains)
            STATS["plans"] += 1
            if wanted == 0:
                late.append(_too_small(rank, max_batch_bytes, rank_plan))
            elif max_batch_bytes is not None:
                fitting = rank_plan.fitting_counts(max_batch_bytes, depth, wanted)
        except ReshardError as e:
            late.append(f"rank {rank}: {e}")
    mine = (
        late,
        wanted,
        rank_plan.send_digest if rank_plan else 0,
        rank_plan.recv_digest if rank_plan else 0,
        int.from_bytes(os.urandom(8), "little"),
        fitting,
        rank_plan.num_ops[0] if rank_plan else 0,
    )
    gathered = all_gather_objects(mine, group, "rx.plan (agreement)", timeout_s)
    errors = [e for errs, *_ in gathered for e in errs]
    if errors:
        _raise(errors)
    sends, recvs = sum(g[2] for g in gathered) % 2**64, sum(g[3] for g in gathered) % 2**64
    if sends != recvs:
        _raise(_digest_mismatch(rank_plan, group, world, timeout_s))
    assert rank_plan is not None  # else this rank's own error was raised above
    rank_plan.assign_batches(_agreed_batches([(g[1], g[5]) for g in gathered]))
    # Identifies this plan on every rank alike, and no other plan: execute's headers
    # carry it (two plans of the same layouts differ by the ranks' random nonces).
    key = repr((sends, sum(g[4] for g in gathered) % 2**64, world)).encode()
    plan_id = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    return Agreement(src_t, dst_t, rank_plan, agreed_device, register, all(relay), plan_id,
                     any(g[6] for g in gathered), host_ring)


def _agreed_batches(wants: list[tuple[int, int | None]]) -> int:
    """The fewest batches every rank accepts: at least what each wants, and for a rank
    bounded by max_batch_bytes a count its `fitting` mask (bit i: wanted + i batches
    fit) allows. The same answer on every rank, from the same gathered values."""
    low = max(k for k, _ in wants)
    for k in range(low, low + 64):
        if all(mask is None or (0 <= k - want < 64 and mask >> (k - want) & 1) for want, mask in wants):
            return k
    _raise([f"max_batch_bytes: no batch count from {low} to {low + 63} keeps the staging of ranks "
            f"{[r for r, (want, mask) in enumerate(wants) if mask is not None]} within their bound at once; "
            f"raise max_batch_bytes"])
    return low


def _registration_vote(device: str | None, options: Options) -> bool:
    """Votes on NCCL buffer registration (GPU transports only; a rank without tensors
    moves nothing and does not object)."""
    if device not in (None, "cuda") or not _C._build_info["nccl"]:
        return False
    from .transports.cuda import registration_vote

    return registration_vote(options)


def _digest_mismatch(rank_plan: Any, group: Any, world: int, timeout_s: float) -> list[str]:
    per_rank = all_gather_objects(rank_plan.digests(), group, "rx.plan (digest mismatch report)", timeout_s)
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
