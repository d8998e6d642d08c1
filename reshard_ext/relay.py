"""Relay fan-out to replicas (DESIGN section 4, step 3).

When a dst tensor's class (a distinct piece) has k replicas but fewer than k src ranks
hold its data, every replica pulling from the sources makes a source send k copies. A
relayed refit moves each such tensor in two phases of ordinary collective plans:

1. scatter: the src entries as given; each replica receives 1/k of its class piece,
   described by `scatter_layout` and bound as a view of its dst tensor (`share`);
2. gather (forwarding): src = those shares (the same views, now holding the bytes),
   dst = the original dst tensors: each replica copies the shares it lacks from the other
   replicas of its class. Its own share is a copy of memory onto itself, which the
   descriptor tables drop (csrc/core/exec_tables.cc), so only the missing shares move.

The phases are pipelined (`Staging`): the relayed tensors split into G groups by bytes
(rx.Tuning.relay_stages), and stage plan s holds the scatter entries of group s beside
the forwarding entries of group s - 1 (named `name#gather`), so the sources' sends and
the replicas' forwards share the links. A source sends each byte about once: for 3
replicas of one source, (G + 1) / G copies' time instead of 3. The C++ planner decides
which tensors relay and along which dim (csrc/core/relay.h), from the global layouts,
alike on every rank. Tensors that do not relay move in the last stage.
`rx.Options(relay=False)` turns it off.

Not done yet: a topology-aware two-level scheme (scatter to one replica group per node,
then intra-node all-gather) for replicas spread over several nodes; the flat all-gather
here sends (k - g)/k of a class piece into each replica over the network when g of its
class's k replicas share its node. Relaying under a transform (rx.MXFP8): such plans
stay direct. Each stage plan has its own staging buffers.
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

from . import _C, groups
from .errors import InternalError, ReshardError
from .execution import Plan, rebind_errors
from .layout import Layout, Mesh, Replicate, Shard, dtype_of
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
MAX_AUTO_STAGES = 8


def stage_groups(sizes: list[tuple[str, int]], stages: int) -> list[list[str]]:
    """Cuts `sizes` ((name, bytes) in table order) into at most `stages` consecutive groups
    of about equal bytes; deterministic, so every rank cuts alike. No group is empty."""
    stages = max(1, min(stages, len(sizes)))
    total = sum(b for _, b in sizes)
    groups: list[list[str]] = [[]]
    acc = 0
    for i, (name, nbytes) in enumerate(sizes):
        left = len(sizes) - i  # keep one tensor for each group still to open
        if groups[-1] and len(groups) < stages and (acc * stages >= len(groups) * total
                                                     or left <= stages - len(groups)):
            groups.append([])
        groups[-1].append(name)
        acc += nbytes
    return groups


def auto_stages(class_bytes: int, batch_bytes: int) -> int:
    """One stage per two batches of the relayed bytes a replica receives, 1 to MAX_AUTO_STAGES:
    a stage of a few batches keeps each plan's batch pipeline full."""
    return max(1, min(MAX_AUTO_STAGES, class_bytes // max(1, 2 * batch_bytes)))


def _class_bytes(table: Any, i: int) -> int:
    layout = table.layout(i)
    return -(-layout.numel * dtype_of(layout.dtype).itemsize // max(1, layout.num_classes))


def gather_names(dims: Mapping[str, int], taken: set[str]) -> dict[str, str]:
    """The name of each relayed tensor's forwarding entries in a stage plan (its own name is
    the scatter's): `name#gather`, with more '#' where a user's tensor already has that name."""
    out = {}
    for name in dims:
        g = f"{name}#gather"
        while g in taken:
            g += "#"
        out[name] = g
    return out


@dataclass(frozen=True)
class Staging:
    """How a relayed refit runs, alike on every rank: stage s (0..G) scatters groups[s]
    (s < G) and forwards groups[s - 1] among the replicas (s > 0); the tensors that do not
    relay move in the last stage, beside the last forwarding (the sources are idle there)."""

    dims: dict[str, int]         # relayed tensor -> split dim
    groups: list[list[str]]      # relayed tensors, G groups
    gather: dict[str, str]       # relayed tensor -> its forwarding entries' name

    def entries(self, src: Entries, dst: Entries, rank: int) -> list[tuple[Local, Local]]:
        """(src, dst) entries of this rank for each of the G + 1 stage plans."""
        last = len(self.groups)
        stage_of = {n: s for s, group in enumerate(self.groups) for n in group}
        out: list[tuple[Local, Local]] = [({}, {}) for _ in range(last + 1)]
        for name, item in src.items():
            out[stage_of.get(name, last)][0][name] = item
        for name, (tensor, layout) in dst.items():
            if name not in self.dims:
                out[last][1][name] = (tensor, layout)
                continue
            s, sl = stage_of[name], scatter_layout(layout, self.dims[name])
            view = share(tensor, layout, self.dims[name], rank)
            if tuple(view.shape) != sl.local_shape(rank):
                raise InternalError(f"relay of '{name}': share {tuple(view.shape)} is not the scatter piece "
                                    f"{sl.local_shape(rank)} of {sl!r} on rank {rank}")
            out[s][1][name] = (view, sl)
            out[s + 1][0][self.gather[name]] = (view, sl)
            out[s + 1][1][self.gather[name]] = (tensor, layout)
        return out


def staging(agreement: Any, dims: Mapping[str, int], stages: int, batch_bytes: int) -> Staging:
    """The groups of a relayed refit from the agreed tables; `stages` 0 picks auto_stages."""
    dst_t = agreement.dst_table
    sizes = [(dst_t.name(i), _class_bytes(dst_t, i)) for i in range(len(dst_t)) if dst_t.name(i) in dims]
    g = stages or auto_stages(sum(b for _, b in sizes), batch_bytes)
    taken = set(dst_t.names()) | set(agreement.src_table.names())
    return Staging(dict(dims), stage_groups(sizes, g), gather_names(dims, taken))


Bind = Callable[[Any, Entries, Entries], Plan]


def relayed_dims(agreement: Any) -> dict[str, int]:
    """{name: split dim} of the tensors whose refit relays (empty when relay is off)."""
    return _split_dims(agreement.src_table, agreement.dst_table) if agreement.relay else {}


def _agreed_stages(options: Options, group: Any) -> int:
    votes: list[Any] = [None] * groups.size(group)
    dist.all_gather_object(votes, options.resolved_relay_stages(), group=group)
    if len(set(votes)) > 1:
        raise ReshardError(f"rx.Tuning(relay_stages=...) / RESHARD_EXT_RELAY_STAGES must be alike on every "
                           f"rank: got {dict(enumerate(votes))}")
    return int(votes[0])


def plan_relayed(agreement: Any, dims: Mapping[str, int], src: Entries, dst: Entries, group: Any,
                 max_batch_bytes: int | None, options: Options, bind: Bind,
                 depth: Callable[[str | None], int] = lambda device: 1) -> RelayPlan:
    """Plans and binds every stage (collective; `bind` binds one agreed plan on every rank;
    depth: the transport's staging copies per batch, for max_batch_bytes)."""
    stages = _agreed_stages(options, group)
    plan_of = staging(agreement, dims, stages, max_batch_bytes or options.resolved_batch_bytes())
    plans = [bind(plan_collective(s, d, group, max_batch_bytes, None, options, depth), s, d)
             for s, d in plan_of.entries(src, dst, groups.rank(group))]
    return RelayPlan(plans, plan_of, src, dst)


class RelayPlan(Plan):
    """A refit as G + 1 plans run one after the other (`phases`, see Staging): the sources'
    scatter of one group shares the links with the replicas' forwarding of the previous
    one. Plan's public interface; byte and op counts are the sums over the stages. One
    execute is one version: plan.version is set once every stage landed, and plan.abort()
    stops whichever stage runs (no later stage starts)."""

    def __init__(self, stages: list[Plan], staging: Staging, src: Entries, dst: Entries):
        # Not Plan.__init__: this plan binds nothing itself, its stages do.
        first = stages[0]
        self.phases = tuple(stages)
        self.staging = staging
        self.group, self.rank, self.options = first.group, first.rank, first.options
        self.backend, self.transform = first.backend, None
        self.relay_dims = staging.dims
        self.relayed_tensors = len(staging.dims)
        self._entries = {"src": dict(src), "dst": dict(dst)}
        self._layouts = {side: {n: l for n, (_, l) in e.items()} for side, e in self._entries.items()}
        self.transport = first.transport  # its channel: one execute per group at a time
        self.version: int | None = None
        self._abort = threading.Event()
        self._running = False

    @property
    def staging_bytes(self) -> int:
        return max(p.staging_bytes for p in self.phases)  # the stages run one after the other

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
        return "; ".join(f"stage {i}: {p.routes}" for i, p in enumerate(self.phases))

    @property
    def peers(self) -> list[int]:
        return sorted({r for p in self.phases for r in p.peers})

    @property
    def num_ops(self) -> tuple[int, int, int]:
        ops = [p.num_ops for p in self.phases]
        return (sum(o[0] for o in ops), sum(o[1] for o in ops), sum(o[2] for o in ops))

    def rebind(self, src: Entries | None = None, dst: Entries | None = None, *, collective: bool = False) -> None:
        # The user's entries are checked against the plan first, as Plan.rebind does, so
        # a mistake leaves every stage bound as it was.
        self.version = None
        given = {"src": src, "dst": dst}
        for side, entries in given.items():
            if entries is not None and not isinstance(entries, Mapping):
                self.phases[0]._bind([f"rebind {side} on rank {self.rank}: expected a dict "
                                      f"{{name: (tensor, rx.Layout)}}, got {type(entries).__name__}"], collective)
        errors = [e for side, entries in given.items() if entries is not None
                  for e in rebind_errors(side, entries, self._layouts[side], self.rank)]
        if errors:
            self.phases[0]._bind(errors, collective)  # raises on this rank (on every rank where binding is collective)
            raise InternalError("rebind: errors not raised")  # pragma: no cover
        new = {side: dict(entries if entries is not None else self._entries[side]) for side, entries in given.items()}
        for p, (s, d) in zip(self.phases, self.staging.entries(new["src"], new["dst"], self.rank)):
            p.rebind(src=s, dst=d, collective=collective)
        self._entries = new

    def abort(self) -> None:
        if self._running:
            self._abort.set()
            for p in self.phases:
                p.transport.abort()

    def _execute(self, verify: bool, version: int | None, timeout: float | None, swap: int | None = None) -> None:
        # Collective, stage by stage on every rank, within Plan.execute's hold of the
        # group's channel. A problem of this rank (arguments, a replaced tensor of any
        # stage) goes into every stage's headers, so the peers raise in each stage instead
        # of waiting for a forwarding this rank never starts. A stage's forwarding reads the
        # shares the previous stage landed.
        # A problem of this rank (arguments, a replaced tensor of any stage) fails the first
        # stage on every rank (its outcome): no later stage starts anywhere.
        problem = next(filter(None, (p._local_problem(version, timeout, verify) for p in self.phases)), "")
        for p in self.phases:
            # the first stage's headers carry a swap's agreement (every rank leaves there together)
            p._run(verify, version, timeout, problem, self._abort, swap if p is self.phases[0] else None)

    def verify(self) -> None:
        # Each stage's check covers its scatter (sources -> shares) and forwarding (shares -> whole pieces).
        for p in self.phases:
            p.verify()  # each phase holds the group's channel while it reads


__all__ = ["Phases", "RelayPlan", "auto_stages", "plan_phases"]
