"""rx.plan / rx.execute (DESIGN section 2) and the Plan object that binds tensors."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist

from . import _C, verification
from ._dtypes import code_of
from .errors import ReshardError
from .layout import Layout
from .options import Options
from .planning import Entries, _check_local, _raise, first_failed_rank, plan_collective
from .transforms import Piece, Transform

BACKENDS = ("auto", "cpu", "torch", "nccl", "direct", "nvshmem")
log = logging.getLogger("reshard_ext")


Steps = tuple[list[Callable[[], None]], list[Callable[[], None]]]  # (before, after)


def _rewrite(transform: Optional[Transform], side: str, entries: Entries) -> tuple[dict, Steps]:
    """Applies `transform` to one side's entries (DESIGN section 5)."""
    out = dict(entries)
    before: list[Callable[[], None]] = []
    after: list[Callable[[], None]] = []
    if transform is None:
        return out, (before, after)
    rewrite = transform.rewrite_src if side == "src" else transform.rewrite_dst
    for name, (tensor, layout) in entries.items():
        rw = rewrite(name, tensor, layout)
        if rw is None:
            continue
        del out[name]
        for new_name, entry in rw.entries.items():
            if new_name in out:
                raise ReshardError(f"transform produced {side} name '{new_name}' twice")
            out[new_name] = entry
        if rw.before is not None:
            before.append(rw.before)
        if rw.after is not None:
            after.append(rw.after)
    return out, (before, after)


def _refs(names: list[str], entries: Mapping[str, tuple[Any, Layout]], tables: Any = None,
          src_dtypes: Optional[list[int]] = None) -> list[tuple]:
    """TensorRef tuples of `names` (aligned with the tables' src_used or dst_used); a
    Piece binds itself, told (destinations) whether its boxes keep its blocks whole."""
    whole: dict[int, set[int]] = {}
    out = []
    for i, name in enumerate(names):
        t = entries[name][0]
        if isinstance(t, Piece):
            if t.group and t.group not in whole:
                whole[t.group] = set(tables.whole_group_dsts(src_dtypes, t.group))
            out.append(t.ref(bool(t.group) and i in whole[t.group]))
        else:
            out.append((t.data_ptr(), list(t.stride()), code_of(t.dtype)))
    return out


def _make_transport(backend: str, device: Optional[str], group: Any, options: Options,
                    register: bool = False) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ReshardError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "nvshmem":
        from . import _nvshmem

        _nvshmem.check_group(group)  # what any rank misses (build, CUDA, libnvshmem), on every rank
        if device not in (None, "cuda"):
            raise ReshardError(f"backend 'nvshmem' needs CUDA tensors, got {device} tensors")
        from .transports.nvshmem import NvshmemTransport

        # Collective: a rank without CUDA, the build or libnvshmem raises on every rank.
        return backend, NvshmemTransport(group, options)
    if backend == "auto":
        if device == "cuda" and _auto_direct(group, options):
            backend = "direct"
        elif device == "cuda":
            from ._nccl import runtime_status

            # torch's CUDA builds bring libnccl; without one, torch's point-to-point still works
            backend = "nccl" if _C._build_info["nccl"] and not runtime_status().startswith("not") else "torch"
        else:
            backend = "cpu"
    if backend == "direct":
        if device not in (None, "cuda"):
            raise ReshardError(f"backend 'direct' needs CUDA tensors, got {device} tensors")
        from .transports.direct import DirectTransport

        return backend, DirectTransport(group, options, register)
    if backend == "cpu":
        if device not in (None, "cpu"):
            raise ReshardError(f"backend 'cpu' cannot move tensors on {device}")
        from .transports.cpu import CpuTransport

        return backend, CpuTransport(group, options)
    if device not in (None, "cuda"):
        raise ReshardError(f"backend {backend!r} needs CUDA tensors, got {device} tensors")
    from .transports.cuda import make_cuda_transport

    return backend, make_cuda_transport(backend, group, options, register)


def _auto_direct(group: Any, options: Options) -> bool:
    """Whether backend "auto" uses the direct transport: only when every rank asks for it
    (rx.Options.auto_direct), since the transports' setups are collectives of their own."""
    votes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(votes, options.resolved_auto_direct(), group=group)
    if any(votes) and not all(votes):
        log.warning("backend 'auto': ranks %s ask for the direct transport, others do not: using NCCL",
                    [r for r, v in enumerate(votes) if v])
    return all(votes)


class Plan:
    """A planned refit bound to tensors. Built by `rx.plan`; run by `rx.execute`."""

    relayed_tensors = 0  # tensors that reach their replicas through a relay (reshard_ext/relay.py)

    def __init__(self, agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps], group: Any,
                 backend: str, transform: Optional[Transform], options: Options):
        self.group = group
        self.rank = dist.get_rank(group)
        self.transform = transform
        self._agreement = agreement
        self.options = options
        # First: choosing the transport may be collective, so every rank gets here before anything can fail.
        self.backend, self.transport = _make_transport(backend, agreement.device, group, options, agreement.register)
        self._set_tables(_C.ExecTables(agreement.rank_plan))
        self._layouts = {"src": {n: l for n, (_, l) in src.items()}, "dst": {n: l for n, (_, l) in dst.items()}}
        self._entries = {"src": dict(src), "dst": dict(dst)}  # keeps bound tensors alive
        self._steps = steps
        self._agreement = agreement
        self._verify_ops: Optional[verification.Ops] = None  # built by the first verify
        # dst table index -> MXFP8 rounding of the tensors whose receiver quantizes them
        # (verify digests cover the quantized bytes; both ends derive it from the transform)
        self._mx_receivers = {} if transform is None else {
            i: r for i, name in enumerate(agreement.dst_table.names())
            if (r := transform.receiver_mx_rounding(name)) is not None}
        self._bind()

    def _set_tables(self, tables: Any) -> None:
        self.tables = tables
        self.src_names = [self._agreement.src_table.name(i) for i in tables.src_used]
        self.dst_names = [self._agreement.dst_table.name(i) for i in tables.dst_used]

    def _bound_refs(self) -> tuple[list[tuple], list[tuple]]:
        """The TensorRefs of the bound tensors, aligned with the tables' src_used / dst_used."""
        src = _refs(self.src_names, self._entries["src"])
        return src, _refs(self.dst_names, self._entries["dst"], self.tables, [r[2] for r in src])

    def _bind(self, errors: Optional[list[str]] = None) -> None:
        if getattr(self.transport, "collective_bind", False):
            # The direct transport splits the plan between its pairs and maps the peers'
            # tensors: collective, and this rank's errors are raised on every rank.
            self.transport.bind_plan(self, errors or [])
            return
        if errors:
            _raise(errors)
        send_bufs, recv_bufs = self.transport.bind(self.tables)
        src, dst = self._bound_refs()
        self.tables.bind(src, dst, send_bufs, recv_bufs, self.transport.direct_bytes, self._mx_receivers)
        self.transport.prepare(self.tables)

    # --- public -------------------------------------------------------------------
    @property
    def num_batches(self) -> int:
        return self.tables.num_batches

    @property
    def bytes_sent(self) -> int:
        return self.tables.send_total + self.tables.direct_send_total

    @property
    def bytes_received(self) -> int:
        return self.tables.recv_total + self.tables.direct_recv_total

    @property
    def num_ops(self) -> tuple[int, int, int]:
        """(sends, receives, same-rank copies) of this rank."""
        sends, recvs, copies = self.tables.num_ops
        direct_sends, direct_recvs = self.tables.num_direct_ops
        return sends + direct_sends, recvs + direct_recvs, copies

    @property
    def routes(self) -> str:
        """What carries this rank's bytes to and from each peer (the plan summary's words)."""
        summary = getattr(self.transport, "summary", None)
        return summary() if summary is not None else self.backend

    def rebind(self, src: Optional[Entries] = None, dst: Optional[Entries] = None) -> None:
        """Swaps in new tensors with the same layouts, without planning again.

        Local (no communication): each rank checks only its own tensors. A side left
        as None keeps its current tensors. With the direct transport it is collective:
        every rank calls it (senders map the receivers' new tensors).
        """
        errors: list[str] = []
        updates = {}
        for side, given in (("src", src), ("dst", dst)):
            if given is None:
                continue
            entries, steps = _rewrite(self.transform, side, given)
            planned = self._layouts[side]
            if set(entries) != set(planned):
                errors.append(
                    f"rebind {side}: names differ from the plan's: missing {sorted(set(planned) - set(entries))[:5]}, "
                    f"extra {sorted(set(entries) - set(planned))[:5]}"
                )
                continue
            for name, (_, layout) in entries.items():
                if layout != planned[name]:
                    errors.append(f"rebind {side} tensor '{name}': layout {layout!r} differs from the planned {planned[name]!r}")
            errors += _check_local(side, entries, self.rank)
            updates[side] = (entries, steps)
        if not errors:
            for side, (entries, steps) in updates.items():
                self._entries[side], self._steps[side] = entries, steps
        self._bind(errors)

    def execute(self, verify: bool = False) -> None:
        for side in ("src", "dst"):
            for step in self._steps[side][0]:
                step()
        digests = self.transport.run(self.tables, verify)
        for side in ("src", "dst"):
            for step in self._steps[side][1]:
                step()
        if verify:
            verification.check(self._ops(), *digests, what="rx.execute(verify=True)")

    def _ops(self) -> verification.Ops:
        if self._verify_ops is None:
            self._verify_ops = verification.Ops(self._agreement.rank_plan, self._agreement.dst_table, self.group,
                                                self.options.resolved_timeout("gloo"))
        return self._verify_ops

    def verify(self) -> None:
        """rx.verify: digests of what the bound sources would send and of what the bound
        destinations hold, compared across ranks; moves no weights. Collective."""
        for step in self._steps["src"][0]:  # a transform's sender-side wire tensors follow the sources
            step()
        send, recv, copy_src, copy_dst = self.transport.read_digests(self.tables)
        verification.check(self._ops(), send, recv, what="rx.verify", copies=(copy_src, copy_dst))


def _bind_agreed(agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps], group: Any, backend: str,
                 transform: Optional[Transform], options: Options) -> Plan:
    # Binding allocates staging and builds descriptor tables on each rank alone: a
    # failure there (e.g. out of memory on one GPU) is agreed on, so every rank raises
    # now rather than the others hanging in the first execute.
    failure: Optional[BaseException] = None
    try:
        p = Plan(agreement, src, dst, steps, group, backend, transform, options)
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        failure = e
    failed = first_failed_rank(group, failure is not None)
    if failure is not None:
        raise failure
    if failed >= 0:
        raise ReshardError(f"rx.plan: rank {failed} failed to set up its part of the plan (staging buffers, "
                           f"descriptor tables or transport); see that rank's error")
    return p


def plan(
    src: Optional[Entries] = None,
    dst: Optional[Entries] = None,
    group: Any = None,
    backend: str = "auto",
    max_batch_bytes: Optional[int] = None,
    transform: Optional[Transform] = None,
    options: Optional[Options] = None,
) -> Plan:
    """Plans moving every dst tensor's piece from the src pieces. Collective over `group`.

    src/dst: {name: (local tensor, rx.Layout)} of the pieces this rank holds (None or {}
    where it holds none). Bad input raises rx.ReshardError on every rank before any
    data moves. The plan binds the tensors: update sources in place between refits.
    """
    if not dist.is_initialized():
        raise ReshardError("rx.plan needs torch.distributed to be initialised (any launcher, any backend)")
    group = group if group is not None else dist.group.WORLD
    if options is not None and not isinstance(options, Options):
        raise ReshardError(f"options must be an rx.Options, got {type(options).__name__}")
    options = options or Options()
    # A transform may reject a tensor on some ranks only: its error joins the first
    # exchange, so every rank raises together instead of some waiting in a collective.
    errors: list[str] = []
    try:
        src_w, src_steps = _rewrite(transform, "src", src or {})
        dst_w, dst_steps = _rewrite(transform, "dst", dst or {})
    except ReshardError as e:
        errors.append(f"rank {dist.get_rank(group)}: {e}")
        src_w, dst_w, src_steps, dst_steps = {}, {}, ([], []), ([], [])
    t0 = time.perf_counter()
    agreement = plan_collective(src_w, dst_w, group, max_batch_bytes, errors, options)

    from . import relay  # relay fan-out: two plans (scatter, gather) where replicas would hammer the sources

    def bind(agreement: Any, src: Entries, dst: Entries, steps: Optional[dict[str, Steps]] = None) -> Plan:
        return _bind_agreed(agreement, src, dst, steps or {"src": ([], []), "dst": ([], [])}, group, backend,
                            transform, options)

    dims = relay.relayed_dims(agreement) if transform is None else {}
    if dims:
        p = relay.plan_relayed(dims, src_w, dst_w, group, max_batch_bytes, options, bind)
    else:
        p = bind(agreement, src_w, dst_w, {"src": src_steps, "dst": dst_steps})
    if log.isEnabledFor(logging.INFO):
        sends, recvs, copies = p.num_ops
        log.info("rank %d: planned %d src / %d dst tensors in %.1f ms: %d sends (%.3f GB), %d receives (%.3f GB), "
                 "%d same-rank copies, %d batch(es), backend %s (%s), %d tensor(s) relayed", p.rank, len(src_w),
                 len(dst_w), 1e3 * (time.perf_counter() - t0), sends, p.bytes_sent / 1e9, recvs,
                 p.bytes_received / 1e9, copies, p.num_batches, p.backend, p.routes,
                 p.relayed_tensors)
    return p


def execute(plan: Plan, *, verify: bool = False) -> None:
    """Runs a refit: every dst tensor of `plan` is updated in place. Collective.

    verify=True: the pack and unpack kernels digest every piece on the sender (what the
    receiver must hold) and on the receiver (what it wrote); only the digests travel,
    and a difference raises ReshardError on every rank naming tensors, boxes and ranks.
    """
    plan.execute(verify)


def verify(plan: Plan) -> None:
    """Re-reads the plan's bound sources and destinations and checks that every
    destination piece holds what its source would send (bit for bit, digests only):
    catches a destination changed after the refit. Collective; moves no weights."""
    plan.verify()
