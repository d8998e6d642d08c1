"""rx.plan / rx.execute (DESIGN section 2) and the Plan object that binds tensors."""
from __future__ import annotations

import logging
import operator
import os
import threading
import time
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from . import _C
from ._dtypes import code_of
from .collectives import all_gather_objects, first_failed_rank
from .errors import ReshardError
from .layout import Layout
from .planning import Entries, _check_local, _raise, batch_bytes_error, plan_collective
from .transforms import Piece, Transform
from .transports import p2p
from .transports.channel import Session

BACKENDS = ("auto", "cpu", "torch", "nccl", "nvshmem")
log = logging.getLogger("reshard_ext")
# RESHARD_EXT_CHECK_STORAGE=0 skips the per-execute check that no bound tensor's storage
# was replaced or resized (_Watch): two attribute reads per bound tensor.
CHECK_STORAGE = os.environ.get("RESHARD_EXT_CHECK_STORAGE", "1") not in ("", "0")


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
            ref = tuple(t.ref(bool(t.group) and i in whole[t.group]))
            ref += (0,) * (6 - len(ref))
        else:
            ref = (t.data_ptr(), list(t.stride()), code_of(t.dtype), 0, 0, 0)
        out.append(ref + (list(t.shape), name))  # shape and name: the memory checks of ExecTables.bind
    return out


def _resolve_backend(backend: str, device: Optional[str]) -> str:
    if backend != "auto":
        return backend
    if device == "cuda":
        return "nccl" if _C._build_info["nccl"] else "torch"
    return "cpu"


def _staging_depth(backend: str, device: Optional[str]) -> int:
    """Staging copies of a batch the transport keeps: the NCCL pipeline double-buffers."""
    return 2 if device == "cuda" and _resolve_backend(backend, device) == "nccl" else 1


def _make_transport(backend: str, device: Optional[str], group: Any, register: bool = False) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ReshardError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "nvshmem":
        # In the DESIGN contract, not built yet: every rank reaches this line alike.
        raise ReshardError("backend 'nvshmem' is not implemented yet; use 'nccl' (or 'auto')")
    backend = _resolve_backend(backend, device)
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
                 backend: str, transform: Optional[Transform], max_batch_bytes: Optional[int] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.transform = transform
        self.device = agreement.device
        self.plan_id = agreement.plan_id
        self.tables = _C.ExecTables(agreement.rank_plan)
        self.src_names = [agreement.src_table.name(i) for i in self.tables.src_used]
        self.dst_names = [agreement.dst_table.name(i) for i in self.tables.dst_used]
        self.backend, self.transport = _make_transport(backend, agreement.device, group, agreement.register)
        self._layouts = {"src": {n: l for n, (_, l) in src.items()}, "dst": {n: l for n, (_, l) in dst.items()}}
        self._entries = {"src": dict(src), "dst": dict(dst)}  # keeps bound tensors alive
        self._steps = steps
        self.version: Optional[int] = None  # the version that fully landed on this rank (see execute)
        self._seq = 0  # executes of this plan whose headers every peer agreed with
        self._abort = threading.Event()
        self._running = False
        self._bind()
        staging = self.transport.staging_bytes
        if max_batch_bytes is not None and staging > max_batch_bytes:
            raise ReshardError(f"rank {self.rank}: the plan's {self.num_batches} batches need {staging} bytes of "
                               f"staging, more than max_batch_bytes={max_batch_bytes}; raise it")

    def _bind(self) -> None:
        send_bufs, recv_bufs = self.transport.bind(self.tables)
        src = _refs(self.src_names, self._entries["src"])
        dst = _refs(self.dst_names, self._entries["dst"], self.tables, [r[2] for r in src])
        self.tables.bind(src, dst, send_bufs, recv_bufs, self.transport.direct_bytes)
        self.transport.prepare(self.tables)
        self._watch = _Watch(self._entries)

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

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging buffers this rank holds for the plan (bounded by max_batch_bytes)."""
        return self.transport.staging_bytes

    def rebind(self, src: Optional[Entries] = None, dst: Optional[Entries] = None) -> None:
        """Swaps in new tensors with the same layouts, without planning again.

        Local (no communication): each rank checks only its own tensors. A side left
        as None keeps its current tensors. On error the plan keeps its tensors.
        """
        errors: list[str] = []
        updates = {}
        for side, given in (("src", src), ("dst", dst)):
            if given is None:
                continue
            if not isinstance(given, Mapping):
                errors.append(f"rebind {side} on rank {self.rank}: expected a dict {{name: (tensor, rx.Layout)}}, "
                              f"got {type(given).__name__}")
                continue
            try:
                entries, steps = _rewrite(self.transform, side, given)
            except Exception as e:  # noqa: BLE001 - a transform rejecting the new tensors
                errors.append(f"rebind {side} on rank {self.rank}: {type(e).__name__}: {e}")
                continue
            local = _check_local(side, entries, self.rank)
            planned = self._layouts[side]
            if local:
                errors += local
                continue
            if set(entries) != set(planned):
                errors.append(
                    f"rebind {side}: names differ from the plan's: missing {sorted(set(planned) - set(entries))[:5]}, "
                    f"extra {sorted(set(entries) - set(planned))[:5]}"
                )
                continue
            for name, (tensor, layout) in entries.items():
                if layout != planned[name]:
                    errors.append(f"rebind {side} tensor '{name}': layout {layout!r} differs from the planned {planned[name]!r}")
                if self.device is not None and tensor.device.type != self.device:
                    errors.append(f"rebind {side} tensor '{name}' on rank {self.rank}: on {tensor.device}, but the "
                                  f"plan moves {self.device} tensors")
            updates[side] = (entries, steps)
        if errors:
            _raise(errors)
        channel = self.transport.channel
        channel.enter()  # never while an execute runs on these tables
        try:
            saved = dict(self._entries), dict(self._steps)
            for side, (entries, steps) in updates.items():
                self._entries[side], self._steps[side] = entries, steps
            try:
                self._bind()
            except Exception:
                self._entries, self._steps = saved
                self._bind()
                raise
            self.version = None
        finally:
            channel.leave()

    def abort(self) -> None:
        """Stops this rank's in-flight execute, from any thread: it raises ReshardError
        promptly and plan.version stays None. Its peers raise within their timeout.
        A no-op when no execute is running."""
        if self._running:
            self._abort.set()
            self.transport.abort()

    def execute(self, version: Optional[int] = None, timeout: Optional[float] = None) -> None:
        """See rx.execute."""
        problem = _execute_args_error(version, timeout)
        timeout_s = p2p.TIMEOUT_S if timeout is None or problem else float(timeout)
        channel = self.transport.channel
        channel.enter()
        try:
            self.version = None
            self._abort.clear()
            self._running = True
            # A local problem is told to the peers in the execute's headers, so that they
            # raise too instead of waiting for this rank's data.
            problem = problem or (self._watch.changed(self.rank) if CHECK_STORAGE else "")
            session = Session(self.plan_id, self._seq + 1, None if problem else version, 1 if problem else 0,
                              time.monotonic() + timeout_s, timeout_s, self._abort)
            session.error = problem
            if problem and not self.transport.peers:
                raise ReshardError(problem)
            try:
                if not problem:
                    for side in ("src", "dst"):
                        for step in self._steps[side][0]:
                            step()
                self.transport.run(self.tables, session)
            finally:
                self._advance(session)
            for side in ("src", "dst"):
                for step in self._steps[side][1]:
                    step()
            self.version = version
        finally:
            self._running = False
            channel.leave()

    def _advance(self, session: Session) -> None:
        """The execute number of this plan, as the peers agreed (headers)."""
        verdict = session.verdict
        if session.status == 0 and (verdict is None or verdict.agreed):
            self._seq = session.seq
        elif verdict.seqs:  # a peer counted differently: meet at the larger count next time
            self._seq = max(self._seq, max(verdict.seqs.values()) - 1)


_PTR = torch.Tensor.data_ptr
_NBYTES = operator.attrgetter("nbytes")


class _Watch:
    """The storages a plan bound, checked before every execute: a tensor whose storage
    was replaced (`param.data = ...`) or resized (`resize_`, FSDP-style freeing) since
    binding would make the kernels read or write memory it no longer owns. Two C-level
    passes over the tensors (data_ptr and nbytes): see benchmarks/host_overhead.py."""


    def __init__(self, entries: dict[str, dict]):
        self.where: list[tuple[str, str]] = []
        self.tensors: list[torch.Tensor] = []
        for side in ("src", "dst"):
            for name, (t, _) in entries[side].items():
                for x in t.tensors() if isinstance(t, Piece) else (t,):
                    self.where.append((side, name))
                    self.tensors.append(x)
        self.ptrs = list(map(_PTR, self.tensors))
        self.sizes = list(map(_NBYTES, self.tensors))

    def changed(self, rank: int) -> str:
        """"" when every bound tensor still has its storage, else what changed."""
        ptrs = list(map(_PTR, self.tensors))
        sizes = list(map(_NBYTES, self.tensors))
        if ptrs == self.ptrs and sizes == self.sizes:
            return ""
        bad = [i for i, (p, n) in enumerate(zip(ptrs, sizes)) if p != self.ptrs[i] or n != self.sizes[i]]
        lines = [f"{self.where[i][0]} tensor '{self.where[i][1]}': data_ptr {self.ptrs[i]:#x} -> {ptrs[i]:#x}, "
                 f"{self.sizes[i]} -> {sizes[i]} bytes" for i in bad[:5]]
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        return (f"rx.execute on rank {rank}: bound tensors were replaced or resized since rx.plan / plan.rebind{more}; "
                f"call plan.rebind(...) with the current tensors:\n  " + "\n  ".join(lines))


def _execute_args_error(version: Any, timeout: Any) -> str:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or not -(1 << 63) <= version < 1 << 63):
        return f"rx.execute: version must be None or a 64-bit integer, got {version!r}"
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        return f"rx.execute: timeout must be None or a positive number of seconds, got {timeout!r}"
    return ""


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
    max_batch_bytes: bound on this rank's staging buffers (send + receive, every
    pipelined copy), in bytes.
    """
    if not dist.is_initialized():
        raise ReshardError("rx.plan needs torch.distributed to be initialised (any launcher, any backend)")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    # Anything wrong with this rank's arguments joins the first exchange, so every rank
    # raises together instead of some waiting in a collective the others skipped.
    errors: list[str] = []
    if backend not in BACKENDS:
        errors.append(f"rank {rank}: unknown backend {backend!r}; choose one of {BACKENDS}")
    problem = batch_bytes_error(max_batch_bytes)
    if problem:
        errors.append(f"rank {rank}: {problem}")
    sides: dict[str, tuple[dict, Steps]] = {}
    for side, given in (("src", src), ("dst", dst)):
        sides[side] = ({}, ([], []))
        if given is not None and not isinstance(given, Mapping):
            errors.append(f"rank {rank}: {side} must be a dict {{name: (tensor, rx.Layout)}} or None, "
                          f"got {type(given).__name__}")
            continue
        try:
            sides[side] = _rewrite(transform, side, given or {})
        except Exception as e:  # noqa: BLE001 - a transform rejecting a tensor on this rank only
            errors.append(f"rank {rank}: {e}" if isinstance(e, ReshardError) else f"rank {rank}: {type(e).__name__}: {e}")
    (src_w, src_steps), (dst_w, dst_steps) = sides["src"], sides["dst"]
    t0 = time.perf_counter()
    agreement = plan_collective(src_w, dst_w, group, None if problem else max_batch_bytes, errors,
                                lambda device: _staging_depth(backend, device))
    # Binding allocates staging and builds descriptor tables on each rank alone: a
    # failure there (e.g. out of memory on one GPU) is agreed on, so every rank raises
    # now rather than the others hanging in the first execute.
    failure: Optional[BaseException] = None
    try:
        p = Plan(agreement, src_w, dst_w, {"src": src_steps, "dst": dst_steps}, group, backend, transform,
                 max_batch_bytes)
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        failure = e
    if first_failed_rank(group, failure is not None) >= 0:
        # Every rank learns every rank's reason (a second round, on this path only).
        reasons = all_gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", group,
                                     "rx.plan (reporting a failed setup)")
        if failure is not None:
            raise failure
        _raise([f"rank {r} failed to set up its part of the plan: {why}" for r, why in enumerate(reasons) if why])
    if log.isEnabledFor(logging.INFO):
        sends, recvs, copies = p.num_ops
        log.info("rank %d: planned %d src / %d dst tensors in %.1f ms: %d sends (%.3f GB), %d receives (%.3f GB), "
                 "%d same-rank copies, %d batch(es), backend %s", p.rank, len(src_w), len(dst_w),
                 1e3 * (time.perf_counter() - t0), sends, p.bytes_sent / 1e9, recvs, p.bytes_received / 1e9,
                 copies, p.num_batches, p.backend)
    return p


def execute(plan: Plan, *, version: Optional[int] = None, timeout: Optional[float] = None) -> None:
    """Runs a refit: every dst tensor of `plan` is updated in place. Collective.

    version: recorded as plan.version once every destination of this rank has landed;
    plan.version is None while an execute runs and after one that failed or was
    aborted. Every rank must pass the same version (checked with its peers).
    timeout: seconds before a missing or stalled peer makes this execute raise
    (default RESHARD_EXT_P2P_TIMEOUT; RESHARD_EXT_NCCL_TIMEOUT for NCCL transfers).
    """
    plan.execute(version=version, timeout=timeout)
