"""rx.plan / rx.execute (DESIGN section 2) and the Plan object that binds tensors."""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch.distributed as dist

from . import _C, groups, verification
from .collectives import all_gather_objects, first_failed_rank
from .errors import ReshardError
from .layout import Layout, code_of
from .options import Options, defaults_for_bad_environment, environment_problems
from .planning import Entries, _check_local, _raise, batch_bytes_error, plan_collective
from .transforms import Piece, Prepass, Transform
from .transports import outcome
from .transports.channel import Session, SwapReplan, exchange_headers
from .watch import Watch

BACKENDS = ("auto", "cpu", "torch", "nccl", "direct", "nvshmem")
log = logging.getLogger("reshard_ext")


# (before, after, prepass, paired): a transform's steps around each execute (transforms.py);
# paired[i] is the `before` of the rewrite that returned prepass[i] (None if it had none), which
# runs right after it where the transport defers it (transforms.py, "Deferred pre-pass work")
Steps = tuple[list[Callable[[], None]], list[Callable[[], None]], list[Prepass], list[Callable[[], None] | None]]


def _no_steps() -> Steps:
    return [], [], [], []


def _rewrite(transform: Transform | None, side: str, entries: Entries) -> tuple[dict, Steps]:
    """Applies `transform` to one side's entries (DESIGN section 5)."""
    out = dict(entries)
    before: list[Callable[[], None]] = []
    after: list[Callable[[], None]] = []
    prepass: list[Prepass] = []
    paired: list[Callable[[], None] | None] = []
    if transform is None:
        return out, (before, after, prepass, paired)
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
            paired.append(rw.before)
    return out, (before, after, prepass, paired)


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
        self.rank = groups.rank(group)
        self.transform = transform
        self._agreement = agreement
        self.max_batch_bytes = max_batch_bytes  # the transports' staging stays within it
        self.options = options = options.with_tuning(host_ring=agreement.host_ring)  # the vote decides
        self.device = agreement.device
        self.plan_id = agreement.plan_id
        self.version: int | None = None  # the version that fully landed on this rank (see execute)
        self._seq = 0  # the number of the last execute of this plan (agreed by every rank at its end)
        self._verifies = 0  # rx.verify calls (each its own alarm token)
        self._stale: tuple[int, int] | None = None  # (plan, seq) of this rank's alarm of an execute that did not count
        self._attempt = 0  # calls with the next execute's number that did not count (Channel.begin_call)
        self._lingering: list[int] = []  # ranks of this host still in the last of them as it ended here
        self._sums: Any = None  # the last outcome's digest sums (a verify check's, where every rank folded them)
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

    def deferrable(self) -> list[tuple[Prepass, Callable[[], None] | None]]:
        """(item, its rewrite's before) of the source-side pre-pass items that a transport may
        run itself, deferred (Prepass.region; transforms.py, "Deferred pre-pass work")."""
        src = self._steps["src"]
        return [(item, before) for item, before in zip(src[2], src[3]) if item.region() is not None]

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
    def peers(self) -> list[int]:
        """The group ranks this rank moves data with."""
        return sorted(self.transport.peers)

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
        promptly, and so does every other rank's (its alarm stops them); plan.version stays
        None everywhere. A no-op when no execute is running, or once this rank's data landed
        (the execute then ends as its outcome says)."""
        if self._running:
            self._abort.set()
            self.transport.abort()

    def execute(self, verify: bool = False, version: int | None = None, timeout: float | None = None,
                swap: int | None = None) -> None:
        """See rx.execute. swap: rx.swap_model_weights' warm call (Session.swap): its agreement
        travels in the headers; SwapReplan where some rank takes the slow path."""
        _check_group(self.group, "rx.execute")
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
        self._run(verify, version, timeout, self._local_problem(version, timeout, verify), self._abort, swap)

    def _local_problem(self, version: Any, timeout: Any, verify: Any = False) -> str:
        """What is wrong on this rank alone before an execute ("" if nothing): told to the
        peers in the execute's headers, so that they raise too instead of waiting."""
        problem = _execute_args_error(version, timeout, verify)
        if not problem and self._check_storage:
            problem = self._watch.changed(self.rank)
        return problem

    def _run(self, verify: bool, version: int | None, timeout: float | None, problem: str,
             abort: threading.Event, swap: int | None = None) -> None:
        """One execute on the caller's channel (held), ended by its outcome on every rank
        (transports/outcome.py): returns on every rank only if every rank's part landed."""
        timeout_s = self._timeout_s if timeout is None or problem else float(timeout)
        session = Session(self.plan_id, self._seq + 1, None if problem else version, 1 if problem else 0,
                          time.monotonic() + timeout_s, timeout_s, abort, swap=swap, attempt=self._attempt)
        session.error, session.verify = problem, bool(verify) and not problem
        # verify=True digests only what crosses ranks (a same-rank copy's two ends would be one
        # kernel's registers): a plan in which no rank sends has nothing to check.
        checked = session.verify and self._agreement.moves
        channel = self.transport.channel
        part = outcome.Part()
        digests: Any = None
        # A rank of this host that aborted this execute before we came has left it: nothing
        # to exchange but the outcome (its headers may be the next execute's already).
        left = [r for r, alarm in channel.alarms(session, channel.others, remote=False).items() if alarm.left]
        if left and not problem:
            part = outcome.Part(outcome.STOPPED)
        rearm = getattr(self.transport, "rearm", None)
        if rearm is not None:  # a transport whose abort outlives an execute (NVSHMEM, direct)
            rearm()
        channel.begin_call(session, self._stale, self._attempt, self._lingering)
        self._stale, self._lingering = None, []
        channel.watch.start(session, self.transport.abort)
        # what the transport runs itself, overlapped with the transfer (transforms.py, "Deferred pre-pass work")
        deferred = {id(step) for pair in getattr(self.transport, "deferred", ()) for step in pair if step is not None}
        try:
            prepass = [it for it in self._steps["src"][2] + self._steps["dst"][2] if id(it) not in deferred]
            if prepass and not left:  # every rank, a failed one too: its partners learn it from it, not a timeout
                why = run_prepasses(prepass, channel, session, problem)
                if why and not problem:
                    problem = why
                    session.status, session.error, session.version, session.verify = 1, why, None, False
                    checked = False
            if left:
                pass
            elif swap is not None and not self.transport.peers:  # a swap round hears every rank, data peers or not
                channel.drain(session)
                exchange_headers(channel, [], session, self.tables.num_batches)
            if not problem and not left:
                for side in ("src", "dst"):
                    for step in self._steps[side][0]:
                        if id(step) not in deferred:
                            step()
            if not left and not (problem and not self.transport.peers and session.verdict is None):
                digests = self.transport.run(self.tables, session, checked)
            if checked and not left:
                part.sums = verification.sums_of(digests)  # waits for the transfers (they may fail)
        except ReshardError as e:
            part = self._failure(session, e)
        except Exception as e:  # noqa: BLE001 - an internal error: the other ranks must hear of it
            log.exception("rank %d: rx.execute failed", self.rank)
            part = outcome.Part(outcome.FAILED, [f"rank {self.rank}: internal error: {type(e).__name__}: {e}"])
        finally:
            channel.watch.end()
        if session.verdict is not None and session.verdict.replan:
            # every rank read every rank's header: all leave the swap round together, no data moved
            channel.end_call()
            raise SwapReplan(f"rank {self.rank}: a rank takes the swap's slow path; no data moved")
        if problem and part.status == outcome.OK:
            part = outcome.Part(outcome.FAILED, [f"rank {self.rank}: {problem}"])
        if part.status == outcome.OK:
            try:
                for side in ("src", "dst"):
                    for step in self._steps[side][1]:
                        step()
            except Exception as e:  # noqa: BLE001 - a transform's write-back failed here alone
                part = outcome.Part(outcome.FAILED, [f"rank {self.rank}: writing back {type(e).__name__}: {e}"])
        # aborted by plan.abort() before its data landed: on one host it leaves without waiting for the others
        aborted = part.status == outcome.FAILED and abort.is_set() and not session.stop_reason
        self._end(session, part, "rx.execute", left=aborted)
        if checked:
            verification.check(self._ops(), digests, what="rx.execute(verify=True)", sums=self._sums)

    def _failure(self, session: Session, e: ReshardError) -> outcome.Part:
        """This rank's part of an execute that raised `e`: its causes (header disagreements,
        a local problem, an abort, a peer it gave up on), or none where it only stopped
        because other ranks failed."""
        me, verdict = self.rank, session.verdict
        if session.status != 0:
            return outcome.Part(outcome.FAILED, [f"rank {me}: {session.error}"])
        if session.remaining() <= 0:  # it waited for a peer past the deadline: has the peer said why?
            self.transport.channel.watch.last_look(session, list(self.transport.peers))
        lines: list[str] = []
        if verdict is not None:
            lines = [why for p, why in sorted(verdict.bad.items()) if p not in verdict.quiet]
        if session.stop_cause:
            lines.append(session.stop_cause)
        elif session.stop_reason:
            lines = [x for x in lines if x in (verdict.disagree if verdict is not None else ())]
        elif session.abort.is_set():
            lines = [f"rank {me}: rx.execute was aborted (plan.abort())"]
        elif not lines and not (verdict is not None and verdict.quiet):
            text = str(e)
            lines = [text if text.startswith(f"rank {me}: ") else f"rank {me}: {text}"]  # transports name the rank
        gave_up = -1
        if session.remaining() <= 0 and verdict is not None and verdict.bad:
            gave_up = min(p for p in verdict.bad if p not in verdict.quiet) if lines else -1
        if session.stop_cause:
            gave_up = session.stop_cause_rank
        return outcome.Part(outcome.FAILED if lines else outcome.STOPPED, lines, gave_up)

    def _end(self, session: Session, part: outcome.Part, what: str, left: bool = False) -> None:
        """The collective end of an execute (or rx.verify): raises on every rank unless every
        rank's part landed. A rank aborted by plan.abort() on one host leaves at once (its
        alarm tells the others not to wait for it)."""
        channel = self.transport.channel
        if part.status == outcome.FAILED:
            channel.raise_alarm(session, "\n".join(part.lines), left and channel.all_local(), part.gave_up)
        try:
            if left and channel.all_local():  # the others do not wait for this rank's row (its alarm says it left)
                self._seq, self._attempt = max(self._seq, session.seq), 0
                raise ReshardError(outcome.Outcome({self.rank: outcome.FAILED}, part.lines, session.seq).message(
                    what) + "; this rank left at once, every other rank raises too")
            result = outcome.agree(channel, session, part)
            counts = session.seq > 0 and result.counts
            if session.seq > 0 and not counts:  # the next execute has this one's number (and token): a retry
                unheard = {r for r, s in result.status.items() if s == outcome.MISSING}
                self._lingering = [r for r in channel.lingering(session, self._attempt) if r in unheard]
        finally:
            channel.end_call()
        if counts:  # every rank ran this call: it counts, at the largest number
            self._seq, self._attempt = max(self._seq, session.seq, result.seq), 0
        else:
            if session.seq > 0:  # an execute (not rx.verify) whose number the next one keeps
                self._attempt = session.attempt + 1  # the count its peers agreed on (exchange_headers)
            if part.status == outcome.FAILED:
                self._stale = (session.plan_id, session.seq)  # its alarm is taken back as the next execute begins
        self._sums = result.sums
        if not result.ok:
            raise ReshardError(result.message(what))

    def _ops(self) -> verification.Ops:
        if self._verify_ops is None:
            self._verify_ops = verification.Ops(self._agreement.rank_plan, self._agreement.dst_table, self.group,
                                                self.options.resolved_timeout("gloo"),
                                                getattr(self.transport, "channel", None), self.plan_id)
        return self._verify_ops

    def verify(self) -> None:
        """rx.verify: digests of what the bound sources would send and of what the bound
        destinations hold, compared across ranks; moves no weights. Collective."""
        _check_group(self.group, "rx.verify")
        channel = self.transport.channel
        channel.enter("rx.verify")
        try:
            self._verifies += 1  # each call its own token (negative: never an execute's)
            session = Session(self.plan_id, -self._verifies, None, 0, time.monotonic() + self._timeout_s,
                              self._timeout_s, threading.Event())
            part = outcome.Part()
            digests: tuple = ()
            channel.begin_call(session)
            try:
                prepass = self._steps["src"][2] + self._steps["dst"][2]
                why = run_prepasses(prepass, channel, session, "") if prepass else ""
                if why:
                    raise ReshardError(why)
                for step in self._steps["src"][0]:  # a transform's sender-side wire tensors follow the sources
                    step()
                digests = self.transport.read_digests(self.tables)
                part.sums = verification.sums_of(digests[:2], (digests[2], digests[3]))
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
                part = outcome.Part(outcome.FAILED, [f"rank {self.rank}: rx.verify could not read its tensors: "
                                                     f"{type(e).__name__}: {e}"])
            self._end(session, part, "rx.verify")
            send, recv, copy_src, copy_dst = digests
            verification.check(self._ops(), (send, recv), what="rx.verify", copies=(copy_src, copy_dst),
                               sums=self._sums)
        finally:
            channel.leave()

    def __repr__(self) -> str:
        return plan_summary(self)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def plan_summary(p: Plan) -> str:
    """What a plan does on this rank, in one line (its repr, and rx.plan's INFO log)."""
    sends, recvs, copies = p.num_ops
    relayed = f"; {p.relayed_tensors} tensor(s) relayed" if p.relayed_tensors else ""
    return (f"<reshard_ext.Plan on rank {p.rank}: {sends} sends ({_size(p.bytes_sent)}) and {recvs} receives "
            f"({_size(p.bytes_received)}) with ranks {p.peers}, {copies} same-rank copies; {p.num_batches} "
            f"batch(es), staging {_size(p.staging_bytes)}; backend {p.backend!r}"
            f"{'' if p.routes == p.backend else ': ' + p.routes}{relayed}; "
            f"version {p.version}>")


def _check_group(group: Any, what: str) -> None:
    """Raises where the plan's process group was destroyed (its channel would still reach
    the peers through the old store, and collectives over it raise torch's ValueError)."""
    if groups.standalone(group) is not None:  # an rx.connect group: closed ones raise here
        groups.require(group, what)
        return
    if not dist.is_initialized() or (isinstance(group, dist.ProcessGroup)
                                     and group not in dist.distributed_c10d._world.pg_map):
        raise ReshardError(f"{what}: the plan's process group was destroyed (torch.distributed.destroy_process_group); "
                           f"make a new plan over the current group")


def _timeout_kind(backend: str, transport: Any) -> str:
    """Which environment default bounds an execute's waits (rx.Options.resolved_timeout)."""
    if backend in ("direct", "nvshmem"):
        return backend
    return "nccl" if getattr(transport, "comm", None) is not None else "gloo"


def _execute_args_error(version: Any, timeout: Any, verify: Any = False) -> str:
    if not isinstance(verify, (bool, np.bool_)):
        return f"rx.execute: verify must be True or False, got {verify!r}"
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
    # Every rank has made its channel: read their announcements now, not in an execute.
    p.transport.channel.learn_peers(rings=bool(getattr(p.transport, "rings", False)))
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
    groups.require(group, "rx.plan")
    group = groups.resolve(group)
    rank = groups.rank(group)
    # Anything wrong with this rank's arguments joins the first exchange, so every rank
    # raises together instead of some waiting in a collective the others skipped.
    errors: list[str] = [f"rank {rank}: {e}" for e in environment_problems()]
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

    with defaults_for_bad_environment():  # a bad variable is in `errors`: every rank raises at the first exchange
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
        log.info("planned %d src / %d dst tensors in %.1f ms: %s", len(src_w), len(dst_w),
                 1e3 * (time.perf_counter() - t0), plan_summary(p))
    return p


def execute(plan: Plan, *, verify: bool = False, version: int | None = None,
            timeout: float | None = None) -> None:
    """Runs a refit: every dst tensor of `plan` is updated in place. Collective, with one
    answer: it returns on every rank only if every rank's destinations landed, else it
    raises ReshardError on every rank naming the ranks that failed and why.

    verify=True: the pack and unpack kernels digest every piece on the sender (what the
    receiver must hold) and on the receiver (what it wrote); only the digests travel,
    and a difference raises ReshardError on every rank naming tensors, boxes and ranks.
    Every rank passes the same verify (checked with its peers, in the execute's headers).
    version: recorded as plan.version once every destination of this rank has landed
    (and, with verify=True, checked); plan.version is None while an execute runs and
    after one that failed or was aborted. Every rank must pass the same version
    (checked with its peers, in the execute's headers).
    timeout: seconds before a missing or stalled peer makes this execute raise
    (default rx.Options.timeout, else RESHARD_EXT_TIMEOUT).
    One execute at a time per process group in a process: a concurrent one (another
    thread) raises ReshardError.
    """
    plan.execute(verify, version, timeout)


def verify(plan: Plan) -> None:
    """Re-reads the plan's bound sources and destinations and checks that every
    destination piece holds what its source would send (bit for bit, digests only):
    catches a destination changed after the refit. Collective; moves no weights."""
    plan.verify()
