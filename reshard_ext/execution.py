"""rx.plan / rx.execute (DESIGN section 2) and the Plan object that binds tensors."""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from . import _C, verification
from .collectives import all_gather_objects, first_failed_rank
from .errors import ReshardError
from .layout import Layout, code_of
from .options import Options
from .planning import Entries, _check_local, _raise, batch_bytes_error, plan_collective
from .transforms import Piece, Prepass, Transform
from .transports.channel import Session, SwapReplan, exchange_headers
from .watch import Watch

BACKENDS = ("auto", "cpu", "torch", "nccl", "direct", "nvshmem")
log = logging.getLogger("reshard_ext")


# (before, after, prepass): a transform's steps around each execute (transforms.py)
Steps = tuple[list[Callable[[], None]], list[Callable[[], None]], list[Prepass]]


def _no_steps() -> Steps:
    return [], [], []


def _rewrite(transform: Transform | None, side: str, entries: Entries) -> tuple[dict, Steps]:
    """Applies `transform` to one side's entries (DESIGN section 5)."""
    out = dict(entries)
    before: list[Callable[[], None]] = []
    after: list[Callable[[], None]] = []
    prepass: list[Prepass] = []
    if transform is None:
        return out, (before, after, prepass)
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
        if rw.prepass is not None:
            prepass.append(rw.prepass)
    return out, (before, after, prepass)


def run_prepasses(items: list[Prepass], channel: Any, session: Session, problem: str) -> str:
    """Runs the transforms' pre-passes of this rank (every class's items in one call, in
    order of first appearance); returns `problem`, or else the first one's failure ("")."""
    by_class: dict[type[Prepass], list[Prepass]] = {}
    for item in items:
        by_class.setdefault(type(item), []).append(item)
    for cls, mine in by_class.items():
        why = cls.run_all(mine, channel, session, problem)
        problem = problem or why
    return problem


def _refs(names: list[str], entries: Mapping[str, tuple[Any, Layout]], tables: Any = None,
          src: list[_C.TensorRef] | None = None) -> list[_C.TensorRef]:
    """TensorRefs of `names` (aligned with the tables' src_used or dst_used); a Piece binds
    itself, told (destinations: `src` are the source refs) whether its boxes keep its
    blocks whole. Each carries its shape and name for ExecTables.bind's memory checks."""
    tensors = [entries[name][0] for name in names]
    plain = [i for i, t in enumerate(tensors) if not isinstance(t, Piece)]
    ts = [tensors[i] for i in plain]
    refs = _C.TensorRef.many([t.data_ptr() for t in ts], [t.stride() for t in ts], [code_of(t.dtype) for t in ts],
                             [t.shape for t in ts], [names[i] for i in plain])
    if len(plain) == len(names):
        return refs
    out = dict(zip(plain, refs))
    whole: dict[tuple[int, int], set[int]] = {}
    for i, (name, t) in enumerate(zip(names, tensors)):
        if isinstance(t, Piece):
            key = (t.group, code_of(t.dtype))
            if t.group and key not in whole:
                whole[key] = set(tables.whole_group_dsts([r.dtype for r in src or ()], *key))
            ref = t.ref(bool(t.group) and i in whole[key])
            if not isinstance(ref, _C.TensorRef):
                raise ReshardError(f"tensor '{name}': {type(t).__name__}.ref returned a {type(ref).__name__}, "
                                   f"not a _C.TensorRef")
            out[i] = ref.replace(shape=t.shape, name=name)
    return [out[i] for i in range(len(names))]


def _staging_depth(backend: str, device: str | None) -> int:
    """Staging copies of a batch the transport keeps: the NCCL pipeline double-buffers
    (an upper bound where "auto" or "direct" end up on torch point-to-point); NVSHMEM keeps
    STAGING_SLOTS slots of symmetric memory."""
    if device == "cuda" and backend == "nvshmem":
        from .transports.nvshmem import STAGING_SLOTS

        return STAGING_SLOTS
    return 2 if device == "cuda" and backend in ("auto", "nccl", "direct") and _C._build_info["nccl"] else 1


def _make_transport(backend: str, device: str | None, group: Any, options: Options,
                    register: bool = False) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ReshardError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "nvshmem":
        from .transports import nvshmem_lib

        nvshmem_lib.check_group(group)  # what any rank misses (build, CUDA, libnvshmem), on every rank
        if device not in (None, "cuda"):
            raise ReshardError(f"backend 'nvshmem' needs CUDA tensors, got {device} tensors")
        from .transports.nvshmem import NvshmemTransport

        # Collective: a rank without CUDA, the build or libnvshmem raises on every rank.
        return backend, NvshmemTransport(group, options)
    if backend == "auto":
        if device == "cuda" and _auto_direct(group, options):
            backend = "direct"
        elif device == "cuda":
            from .transports.nccl_lib import runtime_status

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
    votes = all_gather_objects(options.resolved_auto_direct(), group, "rx.plan (backend 'auto')",
                               options.resolved_timeout("gloo"))
    if any(votes) and not all(votes):
        log.warning("backend 'auto': ranks %s ask for the direct transport, others do not: using NCCL",
                    [r for r, v in enumerate(votes) if v])
    return all(votes)


def rebind_errors(side: str, entries: Entries, planned: Mapping[str, Layout], rank: int,
                  device: str | None = None) -> list[str]:
    """What is wrong with `entries` as the new tensors of a plan's `side` (local checks)."""
    local = _check_local(side, entries, rank)
    if local:
        return local
    if set(entries) != set(planned):
        return [(f"rebind {side}: names differ from the plan's: missing {sorted(set(planned) - set(entries))[:5]}, "
                 f"extra {sorted(set(entries) - set(planned))[:5]}")]
    errors = []
    for name, (tensor, layout) in entries.items():
        if layout != planned[name]:
            errors.append(f"rebind {side} tensor '{name}': layout {layout!r} "
                          f"differs from the planned {planned[name]!r}")
        if device is not None and tensor.device.type != device:
            errors.append(f"rebind {side} tensor '{name}' on rank {rank}: on {tensor.device}, but the "
                          f"plan moves {device} tensors")
    return errors


class Plan:
    """A planned refit bound to tensors. Built by `rx.plan`; run by `rx.execute`."""

    relayed_tensors = 0  # tensors that reach their replicas through a relay (reshard_ext/relay.py)

    def __init__(self, agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps], group: Any,
                 backend: str, transform: Transform | None, options: Options,
                 max_batch_bytes: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.transform = transform
        self._agreement = agreement
        self.options = options = options.replace(host_ring=agreement.host_ring)  # the vote decides
        self.device = agreement.device
        self.plan_id = agreement.plan_id
        self.version: int | None = None  # the version that fully landed on this rank (see execute)
        self._seq = 0  # executes of this plan whose headers every peer agreed with
        self._abort = threading.Event()
        self._running = False
        self._check_storage = options.resolved_check_storage()
        # First: choosing the transport may be collective, so every rank gets here before anything can fail.
        self.backend, self.transport = _make_transport(backend, agreement.device, group, options, agreement.register)
        self._set_tables(_C.ExecTables(agreement.rank_plan))
        self._layouts = {"src": {n: l for n, (_, l) in src.items()}, "dst": {n: l for n, (_, l) in dst.items()}}
        self._entries = {"src": dict(src), "dst": dict(dst)}  # keeps bound tensors alive
        self._steps = steps
        self._agreement = agreement
        self._verify_ops: verification.Ops | None = None  # built by the first verify
        self._refs: tuple[dict[str, _C.TensorRef], dict[str, _C.TensorRef]] = ({}, {})  # by name, as bound
        # dst table index -> _C.ReceiverCodec of the tensors whose receiver converts them
        # (verify digests cover the converted bytes; both ends derive it from the transform)
        self._codec_receivers = {} if transform is None else {
            i: r for i, name in enumerate(agreement.dst_table.names())
            if (r := transform.receiver_codec(name)) is not None}
        self._bind()
        self._timeout_s = options.resolved_timeout(_timeout_kind(self.backend, self.transport))
        staging = self.transport.staging_bytes
        if max_batch_bytes is not None and staging > max_batch_bytes:
            raise ReshardError(f"rank {self.rank}: the plan's {self.num_batches} batches need {staging} bytes of "
                               f"staging, more than max_batch_bytes={max_batch_bytes}; raise it")

    def _set_tables(self, tables: Any) -> None:
        self.tables = tables
        self.src_names = [self._agreement.src_table.name(i) for i in tables.src_used]
        self.dst_names = [self._agreement.dst_table.name(i) for i in tables.dst_used]

    def _bound_refs(self, tables: Any = None) -> tuple[list[_C.TensorRef], list[_C.TensorRef]]:
        """The TensorRefs of the bound tensors, aligned with the src_used / dst_used of the
        plan's tables (which binds them: a Piece decides there whether it lands in place or
        in staging), or of other `tables` of the same agreement: those reuse the refs the
        plan bound (asking a Piece again would rebind it under the other tables' boxes)."""
        if tables is None:
            src = _refs(self.src_names, self._entries["src"])
            dst = _refs(self.dst_names, self._entries["dst"], self.tables, src)
            self._refs = dict(zip(self.src_names, src)), dict(zip(self.dst_names, dst))
            return src, dst
        src_names = [self._agreement.src_table.name(i) for i in tables.src_used]
        dst_names = [self._agreement.dst_table.name(i) for i in tables.dst_used]
        bound_src, bound_dst = self._refs
        if not all(n in bound_src for n in src_names) or not all(n in bound_dst for n in dst_names):
            raise ReshardError(f"rank {self.rank}: tables of this plan use tensors it did not bind (internal error)")
        return [bound_src[n] for n in src_names], [bound_dst[n] for n in dst_names]

    def _bind_tables(self, transport: Any, src: list[_C.TensorRef], dst: list[_C.TensorRef]) -> None:
        """Binds the plan's tables to the refs and to `transport`'s staging; prepares it."""
        send_bufs, recv_bufs = transport.bind(self.tables)
        self.tables.bind(src, dst, send_bufs, recv_bufs, transport.direct_bytes, self._codec_receivers)
        transport.prepare(self.tables)

    def _collective_bind(self, collective: bool = False) -> bool:
        """Whether binding goes through the transport's bind_plan, on every rank."""
        t = self.transport
        return bool(getattr(t, "collective_bind", False) or (collective and getattr(t, "collective_rebind", False)))

    def _bind(self, errors: list[str] | None = None, collective: bool = False) -> None:
        if self._collective_bind(collective):
            # The direct transport splits the plan between its pairs and maps the peers'
            # tensors: collective, and this rank's errors are raised on every rank.
            self.transport.bind_plan(self, errors or [])
        elif errors:
            _raise(errors)
        elif hasattr(self.transport, "rebind_plan"):  # the direct transport's local rebind
            self.transport.rebind_plan(self)
        else:
            self._bind_tables(self.transport, *self._bound_refs())
        self._watch = Watch(self._entries, self.options.resolved_check_threads())

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
    def staging_bytes(self) -> int:
        """Bytes of staging buffers this rank holds for the plan (bounded by max_batch_bytes)."""
        return self.transport.staging_bytes

    @property
    def routes(self) -> str:
        """What carries this rank's bytes to and from each peer (the plan summary's words)."""
        summary = getattr(self.transport, "summary", None)
        return summary() if summary is not None else self.backend

    def rebind(self, src: Entries | None = None, dst: Entries | None = None, *, collective: bool = False) -> None:
        """Swaps in new tensors with the same layouts, without planning again.

        Local (no communication): each rank checks only its own tensors. A side left
        as None keeps its current tensors. With direct pairs too: the rank's next execute
        hands its new destinations to its direct senders (a message and its answer). On
        error the plan keeps its tensors. Refused while an execute of this group runs.
        collective=True, on every rank (None for what it keeps): with the direct transport
        it rebuilds the pairs with every rank, raising each rank's errors on every rank
        (after a failed direct execute, or to move over NCCL a pair whose sender cannot
        map the receiver's new destinations); with other transports it is a local rebind.
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
            found = rebind_errors(side, entries, self._layouts[side], self.rank, self.device)
            if found:
                errors += found
                continue
            updates[side] = (entries, steps)
        channel = self.transport.channel
        channel.enter("plan.rebind")  # never while an execute runs on these tables
        try:
            if errors or self._collective_bind(collective):
                if not errors:
                    for side, (entries, steps) in updates.items():
                        self._entries[side], self._steps[side] = entries, steps
                self._bind(errors, collective)  # collective binds raise this rank's errors on every rank
            else:
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
        promptly and plan.version stays None. A peer raises within its timeout, unless all it
        was to receive had already landed (then its execute completes: its data is whole).
        A no-op when no execute is running."""
        if self._running:
            self._abort.set()
            self.transport.abort()

    def execute(self, verify: bool = False, version: int | None = None, timeout: float | None = None,
                swap: int | None = None) -> None:
        """See rx.execute. swap: rx.swap_model_weights' warm call (Session.swap): its agreement
        travels in the headers; SwapReplan where some rank takes the slow path."""
        channel = self.transport.channel
        channel.enter()
        try:
            self.version = None
            self._abort.clear()
            self._running = True
            try:
                self._execute(verify, version, timeout, swap)
            finally:
                self._running = False
            self.version = version
        finally:
            channel.leave()

    def _execute(self, verify: bool, version: int | None, timeout: float | None, swap: int | None = None) -> None:
        """The body of execute, with the group's channel held (a relayed plan runs two)."""
        self._run(verify, version, timeout, self._local_problem(version, timeout), self._abort, swap)

    def _local_problem(self, version: Any, timeout: Any) -> str:
        """What is wrong on this rank alone before an execute ("" if nothing): told to the
        peers in the execute's headers, so that they raise too instead of waiting."""
        problem = _execute_args_error(version, timeout)
        if not problem and self._check_storage:
            problem = self._watch.changed(self.rank)
        return problem

    def _run(self, verify: bool, version: int | None, timeout: float | None, problem: str,
             abort: threading.Event, swap: int | None = None) -> None:
        """One execute on the caller's channel (held); raises `problem` (after telling the peers)."""
        timeout_s = self._timeout_s if timeout is None or problem else float(timeout)
        session = Session(self.plan_id, self._seq + 1, None if problem else version, 1 if problem else 0,
                          time.monotonic() + timeout_s, timeout_s, abort, swap=swap)
        session.error, session.verify = problem, verify
        # verify=True digests only what crosses ranks (a same-rank copy's two ends would be one
        # kernel's registers): a plan in which no rank sends has nothing to check.
        verify = verify and self._agreement.moves
        prepass = self._steps["src"][2] + self._steps["dst"][2]
        if prepass:  # every rank, a failed one too: its partners then learn it from it, not from their timeout
            why = run_prepasses(prepass, self.transport.channel, session, problem)
            if why and not problem:
                problem = why
                session.status, session.error, session.version = 1, why, None
        if swap is not None and not self.transport.peers:  # a swap round hears every rank, data peers or not
            self.transport.channel.drain(session)
            exchange_headers(self.transport.channel, [], session, self.tables.num_batches)
        if problem and not self.transport.peers and session.verdict is None:
            raise ReshardError(problem)
        try:
            if not problem:
                for side in ("src", "dst"):
                    for step in self._steps[side][0]:
                        step()
            digests = self.transport.run(self.tables, session, verify)
        except ReshardError as e:
            if session.verdict is not None and session.verdict.replan:
                raise SwapReplan(f"rank {self.rank}: a rank takes the swap's slow path; no data moved") from e
            raise
        finally:
            self._advance(session)
        for side in ("src", "dst"):
            for step in self._steps[side][1]:
                step()
        if verify:
            verification.check(self._ops(), digests, what="rx.execute(verify=True)", seq=session.seq,
                               timeout_s=timeout_s)

    def _advance(self, session: Session) -> None:
        """The execute number of this plan, as the peers agreed (headers)."""
        verdict = session.verdict
        if session.status == 0 and (verdict is None or verdict.agreed):
            self._seq = session.seq
        elif verdict is not None and verdict.seqs:  # a peer counted differently: meet at the larger count next time
            self._seq = max(self._seq, max(verdict.seqs.values()) - 1)

    def _ops(self) -> verification.Ops:
        if self._verify_ops is None:
            self._verify_ops = verification.Ops(self._agreement.rank_plan, self._agreement.dst_table, self.group,
                                                self.options.resolved_timeout("gloo"),
                                                getattr(self.transport, "channel", None), self.plan_id)
        return self._verify_ops

    def verify(self) -> None:
        """rx.verify: digests of what the bound sources would send and of what the bound
        destinations hold, compared across ranks; moves no weights. Collective."""
        channel = self.transport.channel
        channel.enter("rx.verify")
        try:
            prepass = self._steps["src"][2] + self._steps["dst"][2]
            if prepass:
                limit = self.options.resolved_timeout("gloo")
                session = Session(self.plan_id, 0, None, 0, time.monotonic() + limit, limit, threading.Event())
                why = run_prepasses(prepass, self.transport.channel, session, "")
                if why:
                    raise ReshardError(f"rx.verify on rank {self.rank}: {why}")
            for step in self._steps["src"][0]:  # a transform's sender-side wire tensors follow the sources
                step()
            send, recv, copy_src, copy_dst = self.transport.read_digests(self.tables)
            verification.check(self._ops(), (send, recv), what="rx.verify", copies=(copy_src, copy_dst))
        finally:
            channel.leave()


def _timeout_kind(backend: str, transport: Any) -> str:
    """Which environment default bounds an execute's waits (rx.Options.resolved_timeout)."""
    if backend in ("direct", "nvshmem"):
        return backend
    return "nccl" if getattr(transport, "comm", None) is not None else "gloo"


def _execute_args_error(version: Any, timeout: Any) -> str:
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or not -(1 << 63) <= version < 1 << 63):
        return f"rx.execute: version must be None or a 64-bit integer, got {version!r}"
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < float("inf")):
        return f"rx.execute: timeout must be None or a positive number of seconds, got {timeout!r}"
    return ""


def _bind_agreed(agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps], group: Any, backend: str,
                 transform: Transform | None, options: Options, max_batch_bytes: int | None) -> Plan:
    # Binding allocates staging and builds descriptor tables on each rank alone: a
    # failure there (e.g. out of memory on one GPU) is agreed on, so every rank raises
    # now rather than the others hanging in the first execute.
    failure: BaseException | None = None
    try:
        p = Plan(agreement, src, dst, steps, group, backend, transform, options, max_batch_bytes)
    except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
        failure = e
    timeout_s = options.resolved_timeout("gloo")
    if first_failed_rank(group, failure is not None, "rx.plan", timeout_s) >= 0:
        # Every rank learns every rank's reason (a second round, on this path only).
        reasons = all_gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", group,
                                     "rx.plan (reporting a failed setup)", timeout_s)
        if failure is not None:
            raise failure
        _raise([f"rank {r} failed to set up its part of the plan: {why}" for r, why in enumerate(reasons) if why])
    return p


def plan(
    src: Entries | None = None,
    dst: Entries | None = None,
    group: Any = None,
    backend: str = "auto",
    max_batch_bytes: int | None = None,
    transform: Transform | None = None,
    options: Options | None = None,
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
    if options is not None and not isinstance(options, Options):
        errors.append(f"rank {rank}: options must be an rx.Options, got {type(options).__name__}")
        options = None
    options = options or Options()
    if backend not in BACKENDS:
        errors.append(f"rank {rank}: unknown backend {backend!r}; choose one of {BACKENDS}")
    problem = batch_bytes_error(max_batch_bytes)
    if problem:
        errors.append(f"rank {rank}: {problem}")
        max_batch_bytes = None
    sides: dict[str, tuple[dict, Steps]] = {}
    for side, given in (("src", src), ("dst", dst)):
        sides[side] = ({}, _no_steps())
        if given is not None and not isinstance(given, Mapping):
            errors.append(f"rank {rank}: {side} must be a dict {{name: (tensor, rx.Layout)}} or None, "
                          f"got {type(given).__name__}")
            continue
        try:
            sides[side] = _rewrite(transform, side, given or {})
        except Exception as e:  # noqa: BLE001 - a transform rejecting a tensor on this rank only
            why = str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}"
            errors.append(f"rank {rank}: {why}")
    (src_w, src_steps), (dst_w, dst_steps) = sides["src"], sides["dst"]
    t0 = time.perf_counter()

    def depth(device: str | None) -> int:
        return _staging_depth(backend, device)

    agreement = plan_collective(src_w, dst_w, group, max_batch_bytes, errors, options, depth,
                                None if transform is None else transform.last_dim_grain)

    from . import relay  # relay fan-out: two plans (scatter, gather) where replicas would hammer the sources

    def bind(agreement: Any, src: Entries, dst: Entries, steps: dict[str, Steps] | None = None,
             options: Options = options) -> Plan:
        return _bind_agreed(agreement, src, dst, steps or {"src": _no_steps(), "dst": _no_steps()}, group, backend,
                            transform, options, max_batch_bytes)

    dims = relay.relayed_dims(agreement) if transform is None else {}
    p: Plan
    if dims:
        staged = options.replace(auto_direct=options.resolved_auto_direct(relayed=True))
        p = relay.plan_relayed(agreement, dims, src_w, dst_w, group, max_batch_bytes, options,
                               functools.partial(bind, options=staged), depth)
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


def execute(plan: Plan, *, verify: bool = False, version: int | None = None,
            timeout: float | None = None) -> None:
    """Runs a refit: every dst tensor of `plan` is updated in place. Collective.

    verify=True: the pack and unpack kernels digest every piece on the sender (what the
    receiver must hold) and on the receiver (what it wrote); only the digests travel,
    and a difference raises ReshardError on every rank naming tensors, boxes and ranks.
    Every rank passes the same verify (checked with its peers, in the execute's headers).
    version: recorded as plan.version once every destination of this rank has landed
    (and, with verify=True, checked); plan.version is None while an execute runs and
    after one that failed or was aborted. Every rank must pass the same version
    (checked with its peers, in the execute's headers).
    timeout: seconds before a missing or stalled peer makes this execute raise
    (default rx.Options.timeout, else RESHARD_EXT_P2P_TIMEOUT / RESHARD_EXT_NCCL_TIMEOUT /
    RESHARD_EXT_DIRECT_TIMEOUT by transport).
    One execute at a time per process group in a process: a concurrent one (another
    thread) raises ReshardError.
    """
    plan.execute(verify, version, timeout)


def verify(plan: Plan) -> None:
    """Re-reads the plan's bound sources and destinations and checks that every
    destination piece holds what its source would send (bit for bit, digests only):
    catches a destination changed after the refit. Collective; moves no weights."""
    plan.verify()
