"""Relay fan-out to replicas (DESIGN section 4, step 3).

When a dst tensor's class (a distinct piece) has k replicas but fewer than k src ranks
hold its data, every replica pulling from the sources makes a source send k copies. A
relayed refit runs two ordinary collective plans instead:

1. scatter: the src entries as given; each replica receives 1/k of its class piece,
   described by `scatter_layout` and bound as a view of its dst tensor (`share`);
2. gather: src = those shares (the same views, now holding the bytes), dst = the
   original dst tensors: each replica copies the shares it lacks from the other replicas
   of its class. Its own share is a copy of memory onto itself, which the descriptor
   tables drop (csrc/core/exec_tables.cc), so only the missing shares move.

A source then sends each byte about once: for 3 replicas of one source, 1 + 2/3 copies'
time instead of 3. The C++ planner decides which tensors relay and along which dim
(csrc/core/relay.h), from the global layouts, alike on every rank. Tensors that do not
relay move in the scatter plan as usual. `rx.Options(relay=False)` turns it off.

Not done yet: a topology-aware two-level scheme (scatter to one replica group per node,
then intra-node all-gather) for replicas spread over several nodes; the flat all-gather
here sends (k - g)/k of a class piece into each replica over the network when g of its
class's k replicas share its node. Relaying under a transform (rx.MXFP8): such plans
stay direct. The two phases do not overlap (the gather starts when the scatter has
landed) and each has its own staging buffers.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _C
from .errors import InternalError, ReshardError
from .execution import Plan
from .layout import Layout, Mesh, Replicate, Shard
from .options import Options
from .planning import Entries, _raise, _table, plan_collective


@functools.lru_cache(maxsize=4096)
def scatter_layout(dst: Layout, dim: int) -> Layout:
    """`dst` as the scatter phase lands it: the mesh transposed so the Replicate dims come
    last (flattened, in replica order), and one Shard(dim) over them that splits each
    class piece among its replicas."""
    shard = [i for i, p in enumerate(dst.placements) if isinstance(p, Shard)]
    repl = [i for i, p in enumerate(dst.placements) if isinstance(p, Replicate)]
    k = math.prod(dst.mesh.shape[i] for i in repl)
    ranks = torch.tensor(dst.mesh.ranks).reshape(dst.mesh.shape).permute(shard + repl)
    mesh = Mesh(ranks.reshape([dst.mesh.shape[i] for i in shard] + [k]))
    return Layout(dst.shape, dst.dtype, mesh, [dst.placements[i] for i in shard] + [Shard(dim)])


def share(tensor: torch.Tensor, dst: Layout, dim: int, rank: int) -> torch.Tensor:
    """The view of `rank`'s dst tensor that its scatter_layout piece is: a class piece cut
    k ways along `dim` in local order (torch.chunk), replica j taking chunk j."""
    pos, coord = dst.mesh.ranks.index(rank), []
    for size in reversed(dst.mesh.shape):
        coord.append(pos % size)
        pos //= size
    coord.reverse()
    j, k = 0, 1
    for i, p in enumerate(dst.placements):
        if isinstance(p, Replicate):
            j, k = j * dst.mesh.shape[i] + coord[i], k * dst.mesh.shape[i]
    n = tensor.shape[dim]
    chunk = -(-n // k)
    lo = min(j * chunk, n)
    return tensor.narrow(dim, lo, min(lo + chunk, n) - lo)


@dataclass(frozen=True)
class Phases:
    """The layouts of a relayed refit's two plans (the scatter's src is the original src)."""

    scatter_dst: dict[str, Layout]  # the dst layouts, relayed tensors' replaced by their scatter_layout
    gather_src: dict[str, Layout]   # the relayed tensors' scatter layouts
    gather_dst: dict[str, Layout]   # their dst layouts

    @property
    def relayed(self) -> list[str]:
        return sorted(self.gather_dst)


def _split_dims(src_table: Any, dst_table: Any) -> dict[str, int]:
    return {dst_table.name(i): dim for i, dim in _C.relay_splits(src_table, dst_table)}


def plan_phases(src_layouts: Mapping[str, Layout], dst_layouts: Mapping[str, Layout],
                options: Options | None = None) -> Phases:
    """Pure (no process group): which tensors relay and the layouts of both phases, as
    rx.plan would choose them. Plan each phase with rx.local_plan: (src, scatter_dst),
    then (gather_src, gather_dst)."""
    src_t, dst_t = _table(src_layouts), _table(dst_layouts)
    errors = _C.check_tables(src_t, dst_t, 0)
    if errors:
        _raise(errors)
    dims = _split_dims(src_t, dst_t) if (options or Options()).resolved_relay() else {}
    scatter = {n: scatter_layout(l, dims[n]) if n in dims else l for n, l in dst_layouts.items()}
    return Phases(scatter, {n: scatter[n] for n in dims}, {n: dst_layouts[n] for n in dims})


Local = dict[str, tuple[Any, Layout]]


def _phase_entries(dims: Mapping[str, int], dst: Entries, rank: int,
                   planned: Mapping[str, Layout] | None = None) -> tuple[Local, Local, Local]:
    """(scatter dst, gather src, gather dst) entries of this rank. With `planned` (rebind),
    an entry whose layout or shape is not the planned one passes through unchanged, for
    the plan's own checks to report."""
    scatter: Local = dict(dst)
    gather_src: Local = {}
    gather_dst: Local = {}
    for name, item in dst.items():
        if name not in dims:
            continue
        tensor, layout = item
        if planned is not None and (layout != planned.get(name) or not isinstance(tensor, torch.Tensor)
                                    or tuple(tensor.shape) != layout.local_shape(rank)):
            continue
        sl = scatter_layout(layout, dims[name])
        view = share(tensor, layout, dims[name], rank)
        if tuple(view.shape) != sl.local_shape(rank):
            raise InternalError(f"relay of '{name}': share {tuple(view.shape)} is not the scatter piece "
                                f"{sl.local_shape(rank)} of {sl!r} on rank {rank}")
        scatter[name] = gather_src[name] = (view, sl)
        gather_dst[name] = (tensor, layout)
    return scatter, gather_src, gather_dst


Bind = Callable[[Any, Entries, Entries], Plan]


def relayed_dims(agreement: Any) -> dict[str, int]:
    """{name: split dim} of the tensors whose refit relays (empty when relay is off)."""
    return _split_dims(agreement.src_table, agreement.dst_table) if agreement.relay else {}


def plan_relayed(dims: Mapping[str, int], src: Entries, dst: Entries, group: Any, max_batch_bytes: int | None,
                 options: Options, bind: Bind, depth: Callable[[str | None], int] = lambda device: 1) -> RelayPlan:
    """Plans and binds both phases (collective; `bind` binds one agreed plan on every rank;
    depth: the transport's staging copies per batch, for max_batch_bytes)."""
    scatter_dst, gather_src, gather_dst = _phase_entries(dims, dst, dist.get_rank(group))
    scatter = bind(plan_collective(src, scatter_dst, group, max_batch_bytes, None, options, depth), src, scatter_dst)
    gather = bind(plan_collective(gather_src, gather_dst, group, max_batch_bytes, None, options, depth),
                  gather_src, gather_dst)
    return RelayPlan(scatter, gather, dict(dims), {n: l for n, (_, l) in dst.items()})


class RelayPlan(Plan):
    """A refit as two plans run back to back: `phases` = (scatter, gather). Plan's public
    interface; byte and op counts are the sums of both phases. One execute is one
    version: plan.version is set once both phases landed, and plan.abort() stops
    whichever phase runs (the gather never starts after an aborted scatter)."""

    def __init__(self, scatter: Plan, gather: Plan, dims: dict[str, int], dst_layouts: dict[str, Layout]):
        # Not Plan.__init__: this plan binds nothing itself, its phases do.
        self.phases = (scatter, gather)
        self.group, self.rank, self.options = scatter.group, scatter.rank, scatter.options
        self.backend, self.transform = scatter.backend, None
        self.relay_dims = dims
        self.relayed_tensors = len(dims)
        self._dst_layouts = dst_layouts
        self.transport = scatter.transport  # its channel: one execute per group at a time
        self.version: int | None = None
        self._abort = threading.Event()
        self._running = False

    @property
    def staging_bytes(self) -> int:
        return max(p.staging_bytes for p in self.phases)  # the phases run one after the other

    @property
    def num_batches(self) -> int:
        return sum(p.num_batches for p in self.phases)

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.phases)

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.phases)

    @property
    def routes(self) -> str:
        return f"scatter: {self.phases[0].routes}; gather: {self.phases[1].routes}"

    @property
    def num_ops(self) -> tuple[int, int, int]:
        a, b = self.phases[0].num_ops, self.phases[1].num_ops
        return (a[0] + b[0], a[1] + b[1], a[2] + b[2])

    def rebind(self, src: Entries | None = None, dst: Entries | None = None) -> None:
        scatter, gather = self.phases
        self.version = None
        if dst is None:
            scatter.rebind(src=src)
            return
        scatter_dst, gather_src, gather_dst = _phase_entries(self.relay_dims, dst, self.rank, self._dst_layouts)
        scatter.rebind(src=src, dst=scatter_dst)  # checks every entry the user gave
        gather.rebind(src=gather_src, dst=gather_dst)

    def abort(self) -> None:
        if self._running:
            self._abort.set()
            for p in self.phases:
                p.transport.abort()

    def _execute(self, verify: bool, version: int | None, timeout: float | None) -> None:
        # Collective, phase by phase on every rank, within Plan.execute's hold of the
        # group's channel. A problem of this rank (arguments, a replaced tensor of either
        # phase) goes into both phases' headers, so the peers raise in each phase instead
        # of waiting for a gather this rank never starts.
        problem = next(filter(None, (p._local_problem(version, timeout) for p in self.phases)), "")
        first: ReshardError | None = None
        for p in self.phases:
            if self._abort.is_set():
                raise ReshardError("rx.execute was aborted (plan.abort()) between the relay's scatter and gather")
            try:
                p._run(verify, version, timeout, problem, self._abort)
            except ReshardError as e:
                if not problem:
                    raise
                first = first or e
        if first is not None:
            raise first

    def verify(self) -> None:
        # The scatter's check covers sources -> shares, the gather's shares -> whole pieces.
        for p in self.phases:
            p.verify()  # each phase holds the group's channel while it reads
