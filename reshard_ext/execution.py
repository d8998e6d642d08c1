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
from .planning import Entries, _check_local, _raise, first_failed_rank, plan_collective
from .transforms import Piece, Transform

BACKENDS = ("auto", "cpu", "torch", "nccl", "nvshmem")
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


def _make_transport(backend: str, device: Optional[str], group: Any, register: bool = False) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ReshardError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "nvshmem":
        # In the DESIGN contract, not built yet: every rank reaches this line alike.
        raise ReshardError("backend 'nvshmem' is not implemented yet; use 'nccl' (or 'auto')")
    if backend == "auto":
        if device == "cuda":
            backend = "nccl" if _C._build_info["nccl"] else "torch"
        else:
            backend = "cpu"
    if backend == "cpu":
        if device not in (None, "cpu"):
            raise ReshardError(f"backend 'cpu' cannot move tensors on {device}")
        from .transports.cpu import CpuTransport

        return backend, CpuTransport(group)
    if device not in (None, "cuda"):
        raise ReshardError(f"backend {backend!r} needs CUDA tensors, got {device} tensors")
    from .transports.cuda import make_cuda_transport

    return backend, make_cuda_transport(backend, group, register)


class Plan:
    """A planned refit bound to tensors. Built by `rx.plan`; run by `rx.execute`."""

    def __init__(self, agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps], group: Any,
                 backend: str, transform: Optional[Transform]):
        self.group = group
        self.rank = dist.get_rank(group)
        self.transform = transform
        self.tables = _C.ExecTables(agreement.rank_plan)
        self.src_names = [agreement.src_table.name(i) for i in self.tables.src_used]
        self.dst_names = [agreement.dst_table.name(i) for i in self.tables.dst_used]
        self.backend, self.transport = _make_transport(backend, agreement.device, group, agreement.register)
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

    def _bind(self) -> None:
        send_bufs, recv_bufs = self.transport.bind(self.tables)
        src = _refs(self.src_names, self._entries["src"])
        dst = _refs(self.dst_names, self._entries["dst"], self.tables, [r[2] for r in src])
        self.tables.bind(src, dst, send_bufs, recv_bufs, self.transport.direct_bytes, self._mx_receivers)
        self.transport.prepare(self.tables)

    # --- public -------------------------------------------------------------------
    @property
    def num_batches(self) -> int:
        return self.tables.num_batches

    @property
    def bytes_sent(self) -> int:
        return self.tables.send_total

    @property
    def bytes_received(self) -> int:
        return self.tables.recv_total

    @property
    def num_ops(self) -> tuple[int, int, int]:
        """(sends, receives, same-rank copies) of this rank."""
        return tuple(self.tables.num_ops)

    def rebind(self, src: Optional[Entries] = None, dst: Optional[Entries] = None) -> None:
        """Swaps in new tensors with the same layouts, without planning again.

        Local (no communication): each rank checks only its own tensors. A side left
        as None keeps its current tensors.
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
        if errors:
            _raise(errors)
        for side, (entries, steps) in updates.items():
            self._entries[side], self._steps[side] = entries, steps
        self._bind()

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
            self._verify_ops = verification.Ops(self._agreement.rank_plan, self._agreement.dst_table, self.group)
        return self._verify_ops

    def verify(self) -> None:
        """rx.verify: digests of what the bound sources would send and of what the bound
        destinations hold, compared across ranks; moves no weights. Collective."""
        for step in self._steps["src"][0]:  # a transform's sender-side wire tensors follow the sources
            step()
        send, recv, copy_src, copy_dst = self.transport.read_digests(self.tables)
        verification.check(self._ops(), send, recv, what="rx.verify", copies=(copy_src, copy_dst))


def plan(
    src: Optional[Entries] = None,
    dst: Optional[Entries] = None,
    group: Any = None,
    backend: str = "auto",
    max_batch_bytes: Optional[int] = None,
    transform: Optional[Transform] = None,
) -> Plan:
    """Plans moving every dst tensor's piece from the src pieces. Collective over `group`.

    src/dst: {name: (local tensor, rx.Layout)} of the pieces this rank holds (None or {}
    where it holds none). Bad input raises rx.ReshardError on every rank before any
    data moves. The plan binds the tensors: update sources in place between refits.
    """
    if not dist.is_initialized():
        raise ReshardError("rx.plan needs torch.distributed to be initialised (any launcher, any backend)")
    group = group if group is not None else dist.group.WORLD
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
    agreement = plan_collective(src_w, dst_w, group, max_batch_bytes, errors)
    # Binding allocates staging and builds descriptor tables on each rank alone: a
    # failure there (e.g. out of memory on one GPU) is agreed on, so every rank raises
    # now rather than the others hanging in the first execute.
    failure: Optional[BaseException] = None
    try:
        p = Plan(agreement, src_w, dst_w, {"src": src_steps, "dst": dst_steps}, group, backend, transform)
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        failure = e
    failed = first_failed_rank(group, failure is not None)
    if failure is not None:
        raise failure
    if failed >= 0:
        raise ReshardError(f"rx.plan: rank {failed} failed to set up its part of the plan (staging buffers, "
                           f"descriptor tables or transport); see that rank's error")
    if log.isEnabledFor(logging.INFO):
        sends, recvs, copies = p.num_ops
        log.info("rank %d: planned %d src / %d dst tensors in %.1f ms: %d sends (%.3f GB), %d receives (%.3f GB), "
                 "%d same-rank copies, %d batch(es), backend %s", p.rank, len(src_w), len(dst_w),
                 1e3 * (time.perf_counter() - t0), sends, p.bytes_sent / 1e9, recvs, p.bytes_received / 1e9,
                 copies, p.num_batches, p.backend)
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
