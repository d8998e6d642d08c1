"""The direct transport's tables, run in one process on CPU tensors (no process group, no
GPU): every rank's plan is split between direct pairs and "NCCL" pairs as the transport
splits it; direct boxes are bound to the receivers' own tensors (one address space, so
the peer mapping is the identity); copy-engine copies run as row memmoves, kernel boxes
through the CPU twin; NCCL pairs pack, exchange their messages by memmove and unpack.
What it checks is everything the transport decides on the host: which ops each side
keeps, the batch layout both ends of an NCCL pair share, the geometry of every direct
box and copy-engine copy, and the casts and MX modes they carry; a sender's staged codec
boxes run through StagedRun, the CPU emulation of their staging script."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from reshard_ext import _C
from reshard_ext.execution import _refs, _rewrite
from reshard_ext.options import Options
from reshard_ext.transports.direct import peers_of, run_deferred, staging_shape

LANDING_GROUPS = Options().resolved_direct_verify_groups()  # what a verified direct execute uses


def _table(entries: list[dict]) -> Any:
    return _C.LayoutTable([(n, layout._c) for e in entries for n, (_, layout) in e.items()])


def run_engine(copies: list[tuple]) -> tuple[int, int]:
    """Runs split_engines' copies as DirectExec submits them (batch_engines: runs, adjacent
    ones merged, and pitched copies), as row memmoves; returns (runs, pitched) submitted."""
    runs, pitched = _C.batch_engines(copies)
    for dst, dpitch, src, spitch, width, height in runs + pitched:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
    return len(runs), len(pitched)


_PACK, _COPY, _WAIT, _RECORD, _DIGEST = 0, 1, 2, 3, 4  # StageOp (core/direct.h)
_PREPARE = 5  # the emulation's own action: deferred pre-pass work k (the transport's, on its prep stream)
_SIGNAL = -1  # the executor's signal stream in the emulation
_PREP = -2  # the transport's prep stream


def prep_event(k: int) -> int:
    """The id of prep event k in a staging script (core/direct.h, stage_prep_event)."""
    return _C.STAGE_PREP0 - k


class StagedRun:
    """A sender's staged codec boxes (core/direct.h: plan_staging, stage_script), run on the
    CPU as DirectExec queues them: the script's actions go to their streams in host order,
    then each stream runs its actions in order, a wait holding its stream until the event's
    latest record queued before it has run (CUDA's rule); which ready stream runs next is
    chosen by `policy` ("pack": the pack stream whenever it can, "copy": the copy streams
    first, else a seeded random choice), so a wait the script lacks shows as a slot packed
    before it was copied out or as a chunk missing when its group is signalled. Packs run
    through the CPU twin into a poisoned ring, copies as row memmoves.

    `landing` (the landing groups, 0: one part) also runs the executor's signal: after part k
    a signal stream waits for every copy stream's group-end event, then records
    kStageLanded; `run()` yields k when that signal runs, every chunk of groups <= k copied.
    A landing run's script digests each chunk's slot after its pack (a verified execute): the
    digests of the staged boxes, in staged order, land in `digests` (uint64, lane sums), each
    read while its chunk is in its slot, all of them before the last signal.

    `prep` (work, gates): deferred pre-pass work (rx.Tuning.direct_prep_overlap) on a prep
    stream that starts at the sources (STAGE_SOURCES), runs work[k]() and records prep event k,
    for each k in turn; the script's packs wait for the prep events `gates` says
    (prep_schedule's), and the signal stream (everything the executor does besides the packs)
    for the last one. A pack that a missing or early gate lets run before its tensor's work
    quantizes with stale factors: the bytes show it."""

    def __init__(self, boxes: Any, groups: list[int], stageable: list[int], slot_bytes: int, landing: int = 0,
                 policy: str | int = 0, edit: Any = None, ordinals: list[int] | None = None,
                 slots: int = _C.STAGE_SLOTS, streams: int = _C.STAGE_STREAMS, prep: Any = None):
        import random

        import numpy as np

        self.plan, self.rest = _C.plan_staging(boxes, groups, stageable, slot_bytes, ordinals or [], slots)
        self.streams = streams
        self.landing = landing
        self.ring = torch.full((max(1, self.plan.ring_bytes),), 0xA5, dtype=torch.uint8)
        self.plan.relocate(self.ring.data_ptr())
        self.chunks = [self.plan.chunk(c) for c in range(self.plan.num_chunks)]
        self.first = [0]  # per chunk: its first box in staged order
        for ch in self.chunks:
            self.first.append(self.first[-1] + len(ch[5]))
        self.digests = np.zeros(self.first[-1], dtype=np.uint64)
        self.digested = 0
        self.policy = policy
        self.edit = edit  # tests: a function of the script (streams, events, prefill, parts) that breaks it
        self.rng = random.Random(policy if isinstance(policy, int) else 0)
        self.packs = self.copies = 0
        self.max_ahead = 0  # the most chunks packed and not yet copied out at once
        self.prep = prep
        self.prepared = 0  # deferred work items run

    def rest_boxes(self, boxes: Any) -> Any:
        """The boxes the staging left to the kernel and the copy engines (a table)."""
        import numpy as np

        records = np.frombuffer(boxes, dtype=np.uint8).reshape(-1, _C.BOX_BYTES)
        return records[np.asarray(self.rest, dtype=np.int64)].copy() if len(records) else records

    def _queue(self) -> tuple[dict, dict]:
        """Every stream's actions in host order, each wait with the record count it waits for."""
        work, gates = self.prep or ([], [])
        script = self.plan.script(self.landing, self.streams, bool(self.landing), gates)
        streams, events, prefill, parts = self.edit(*script) if self.edit else script
        queued = {_C.STAGE_START: 1, _C.STAGE_SOURCES: 1}  # the execute's start is recorded before anything
        q: dict[int, list] = {}

        def put(op: int, stream: int, arg: int, tag: int = 0) -> None:
            # a wait: the records queued so far; a record: its tag (the part a signal ends)
            q.setdefault(stream, []).append((op, arg, queued.get(arg, 0) if op == _WAIT else tag))
            if op == _RECORD:
                queued[arg] = queued.get(arg, 0) + 1

        if work:  # queued before the executor's begin; the executor's work waits for all of it
            put(_WAIT, _PREP, _C.STAGE_SOURCES)
            for k in range(len(work)):
                put(_PREPARE, _PREP, k)
                put(_RECORD, _PREP, prep_event(k))
            put(_WAIT, _SIGNAL, prep_event(len(work) - 1))
        for a in prefill:
            put(*a)
        for k, part in enumerate(parts):
            for a in part:
                put(*a)
            if self.plan.num_chunks:  # the executor: wait for every copy stream's group end, then signal
                for e in range(streams):
                    put(_WAIT, _SIGNAL, 2 * self.plan.slots + e)
                if k + 1 == len(parts) and events > 2 * self.plan.slots + streams:  # and the last, for the digests
                    put(_WAIT, _SIGNAL, 2 * self.plan.slots + streams)
                put(_RECORD, _SIGNAL, _C.STAGE_LANDED, k)
        return q

    def run(self) -> Any:
        """Runs every action; yields the part k of each signal as it runs."""
        from collections import deque

        queues = {s: deque(a) for s, a in self._queue().items()}
        done = {_C.STAGE_START: 1, _C.STAGE_SOURCES: 1}  # records run, by event
        held: dict[int, int] = {}  # slot -> the chunk packed into it and not copied out yet
        in_slot: dict[int, int] = {}  # slot -> the chunk last packed into it (copied out or not)
        copied: set[int] = set()
        while any(queues.values()):
            ready = [s for s, a in queues.items() if a and (a[0][0] != _WAIT or done.get(a[0][1], 0) >= a[0][2])]
            assert ready, f"staging script deadlocks: stream heads {[(s, a[0]) for s, a in queues.items() if a]}"
            if self.policy == "pack" and 0 in ready:
                s = 0
            elif self.policy == "copy" and [r for r in ready if r > 0]:
                s = min(r for r in ready if r > 0)
            else:
                s = self.rng.choice(sorted(ready))
            op, arg, want = queues[s].popleft()
            if op == _RECORD:
                done[arg] = done.get(arg, 0) + 1
                if s == _SIGNAL:  # every chunk of the groups signalled so far must be out
                    k = want
                    due = [c for c, ch in enumerate(self.chunks) if not self.landing or ch[0] <= k]
                    late = [c for c in due if c not in copied]
                    assert not late, f"part {k} signalled before chunks {late} were copied out"
                    if self.landing and k + 1 == self.landing:
                        assert self.digested == len(self.chunks), "the last signal before every chunk's digest"
                    yield k
            elif op == _PREPARE:
                self.prep[0][arg]()
                self.prepared += 1
            elif op == _DIGEST:
                slot, digest = self.chunks[arg][1], self.chunks[arg][6]
                assert in_slot.get(slot) == arg, f"chunk {arg} digested from slot {slot} holding {in_slot.get(slot)}"
                got = _C.digest_boxes_cpu(digest, _C.PASS_SRC)
                self.digests[self.first[arg]:self.first[arg + 1]] = got
                self.digested += 1
            elif op == _PACK:
                slot, pack = self.chunks[arg][1], self.chunks[arg][3]
                assert slot not in held, f"chunk {arg} packed into slot {slot} before chunk {held[slot]} left it"
                _C.copy_boxes_cpu(pack)
                held[slot] = in_slot[slot] = arg
                self.packs += 1
                self.max_ahead = max(self.max_ahead, len(held))
            elif op == _COPY:
                slot, copies = self.chunks[arg][1], self.chunks[arg][4]
                assert held.get(slot) == arg, f"chunk {arg} copied out of slot {slot} holding {held.get(slot)}"
                run_engine(copies)
                del held[slot]
                copied.add(arg)
                self.copies += 1
        assert self.packs == self.copies == len(self.chunks) == len(copied), (self.packs, self.copies, len(self.chunks))
        assert self.prepared == len(self.prep[0] if self.prep else []), "deferred work left undone"

    def run_all(self) -> None:
        for _ in self.run():
            pass


def simulate(src: list[dict], dst: list[dict], direct: set[tuple[int, int]], engine_bytes: int = 1 << 20,
             max_batch_bytes: int = 0, transform: Any = None, stats: dict | None = None,
             local_engine_bytes: int | None = None, engine_streams: int = 1, landing: bool = False,
             stage_bytes: int = 0, policy: str | int = 0, prep: bool = False, executes: int = 1,
             each: Any = None, gates: Any = None) -> None:
    """Runs one refit of per-rank entries {name: (tensor, layout)} (CPU tensors) with the
    pairs in `direct` (as (low, high) rank pairs) direct and the others over "NCCL".
    transform: one for every rank, or a function rank -> the rank's (a transform that asks
    for its rank, e.g. for its amax pre-pass). Pre-pass items (amax pieces) run as the plan
    runs them, their exchange emulated (a MAX over the ranks' grids of a tensor).
    local_engine_bytes: the same-rank copies of ranks without "NCCL" pairs are split as
    DirectExec splits them (copy engine / kernel) instead of the inner transport's copy.
    engine_streams: the copy-engine copies are spread over that many streams first.
    landing: the direct writes run group by group (a verified execute's landing groups);
    each receiver digests the ops it expects in group k once every sender wrote group k,
    and each of those digests must equal the op's digest after the whole refit.
    stage_bytes: the slot of the ring a sender's codec boxes are staged in (StagedRun, run
    in `policy`'s order; 0: none staged, the kernel writes them as before).
    prep: deferred pre-pass work as the direct transport runs it (rx.Tuning.direct_prep_overlap):
    the items the staged chunks read run in StagedRun's prep stream, gated per chunk
    (gates: a function of prep_schedule's gates that breaks them, for tests); the rest of a
    rank's work after all of it. executes: refits in a row; each(k) after the k-th (it may
    check the destinations and change the sources in place)."""
    world = len(src)
    make = transform if callable(transform) else (lambda r: transform)
    rewritten = []
    for r in range(world):
        t_r = make(r)
        rewritten.append((_rewrite(t_r, "src", src[r]), _rewrite(t_r, "dst", dst[r])))
    src_w = [s for (s, _), _ in rewritten]
    dst_w = [d for _, (d, _) in rewritten]
    src_t, dst_t = _table(src_w), _table(dst_w)
    assert not _C.check_tables(src_t, dst_t, world)
    plans = [_C.plan_rank(src_t, dst_t, r, max_batch_bytes) for r in range(world)]
    k0 = max(p.wanted_batches() for p in plans)
    for p in plans:
        p.assign_batches(k0)
    # What the transport does once the pairs are agreed: split, then agree on batches again.
    splits = [_C.split_direct(plans[r], src_t, peers_of(direct, r)) for r in range(world)]
    k = max(s.wanted_batches() for s in splits)
    for s in splits:
        s.assign_batches(k)
    tables = [_C.ExecTables(s) for s in splits]
    refs = []
    for r in range(world):
        names_s = [src_t.name(i) for i in tables[r].src_used]
        names_d = [dst_t.name(i) for i in tables[r].dst_used]
        s_refs = _refs(names_s, src_w[r])
        refs.append((s_refs, _refs(names_d, dst_w[r], tables[r], s_refs)))
    nbuf = 2 if k > 1 else 1
    staging = []
    for r in range(world):
        t = tables[r]
        bufs = ([torch.empty(max(1, t.send_buffer_bytes), dtype=torch.uint8) for _ in range(nbuf)],
                [torch.empty(max(1, t.recv_buffer_bytes), dtype=torch.uint8) for _ in range(nbuf)])
        staging.append(bufs)
        t.bind(refs[r][0], refs[r][1], [b.data_ptr() for b in bufs[0]], [b.data_ptr() for b in bufs[1]], 0)
    # Each sender binds the receivers' pieces it writes into (identity mapping here).
    for r in range(world):
        pieces = []
        for q in range(world):
            for peer, pos in tables[q].direct_recv_pieces():
                if peer == r:
                    pieces.append(_C.PeerPiece(q, int(tables[q].dst_used[pos]), refs[q][1][pos]))
        tables[r].bind_direct(refs[r][0], pieces, stage_bytes)
    groups = LANDING_GROUPS if landing else 0
    slots, streams = staging_shape()

    def staged_run(t: Any, work: Any = None) -> StagedRun:
        return StagedRun(t.direct_boxes(), t.direct_landing_groups(max(groups, 1)), t.direct_stageable(), stage_bytes,
                         groups, policy, ordinals=t.direct_ordinals(), slots=slots, streams=streams, prep=work)

    staged = [staged_run(t) for t in tables]
    # what each rank's transport defers (DirectTransport._defer): (item, before) in the chunks' order, and the gates
    deferred: list[list] = [[] for _ in range(world)]
    gated: list[list[int]] = [[] for _ in range(world)]
    for r in range(world):
        steps = rewritten[r][0][1]
        candidates = [(it, b) for it, b in zip(steps[2], steps[3]) if it.region() is not None]
        if prep and candidates and staged[r].plan.num_chunks:
            order, gated[r] = staged[r].plan.prep_schedule([it.region() for it, _ in candidates])
            deferred[r] = [candidates[i] for i in order]
            gated[r] = gates(list(gated[r])) if gates is not None else list(gated[r])
    if stats is not None:
        stats.update(batches=k, staging=[t.send_buffer_bytes + t.recv_buffer_bytes for t in tables],
                     direct_ops=[tuple(t.num_direct_ops) for t in tables], ops=[tuple(t.num_ops) for t in tables],
                     engine=0, kernel=0, runs=0, pitched=0, local_engine=0, local_kernel=0,
                     direct_boxes=sum(len(t.direct_boxes()) for t in tables),
                     staged=sum(len(t.direct_boxes()) - len(s.rest) for t, s in zip(tables, staged)),
                     chunks=sum(s.plan.num_chunks for s in staged), ring=[s.plan.ring_bytes for s in staged],
                     slot=[s.plan.slot_bytes for s in staged], deferred=[len(d) for d in deferred])
    def work(r: int) -> Any:
        return ([functools.partial(run_deferred, pair) for pair in deferred[r]], gated[r]) if deferred[r] else None

    for step in range(executes):
        staged = [staged_run(t, work(r)) for r, t in enumerate(tables)]  # a fresh ring each execute
        _execute(rewritten, deferred, gated, plans, splits, tables, refs, staged, direct, engine_bytes, stats,
                 local_engine_bytes, engine_streams, landing, k)
        if each is not None:
            each(step)


def _prepass(rewritten: list, deferred: list[list]) -> None:
    """Every rank's pre-pass and before steps but what its transport defers: the amax pieces'
    partial amaxes, those of tensors whose pieces cut blocks reduced as the ranks' exchange
    does (a MAX over their grids), then the before steps."""
    from reshard_ext.codecs.amax import AmaxPiece

    skip = {id(x) for d in deferred for pair in d for x in pair if x is not None}
    shared: dict[str, list] = {}
    for (_, src_steps), (_, dst_steps) in rewritten:
        for item in src_steps[2] + dst_steps[2]:
            if id(item) in skip:
                continue
            assert isinstance(item, AmaxPiece), f"the emulation runs amax pieces only, got {type(item).__name__}"
            item.partial()
            if item.senders or item.receivers:
                shared.setdefault(item.name, []).append(item)
    for items in shared.values():
        whole = torch.stack([it.grid for it in items]).amax(0)  # int32 order = float order (codecs/amax.py)
        for it in items:
            it.grid.copy_(whole)
    for (_, src_steps), (_, dst_steps) in rewritten:
        for step in src_steps[0] + dst_steps[0]:
            if id(step) not in skip:
                step()


def _execute(rewritten: list, deferred: list[list], gated: list[list[int]], plans: list, splits: list, tables: list,
             refs: list, staged: list, direct: set, engine_bytes: int, stats: dict | None,
             local_engine_bytes: int | None, engine_streams: int, landing: bool, k: int) -> None:
    """One execute of simulate's bound tables: the pre-pass, the writes, the NCCL batches, the after steps."""
    world = len(tables)
    _prepass(rewritten, deferred)
    locals_ = []
    for r in range(world):
        t = tables[r]

        def local(t: Any = t) -> None:
            if local_engine_bytes is None or t.send_total or t.recv_total:
                t.run_copies_cpu()
            else:
                copies, kernel = _C.split_engines(t.copy_boxes(), local_engine_bytes)
                run_engine(copies)
                _C.copy_boxes_cpu(kernel)
                if stats is not None:
                    stats["local_engine"] += len(copies)
                    stats["local_kernel"] += len(kernel)

        locals_.append(local)
        if not deferred[r]:  # else after all of it, as the executor's start
            local()
        if landing:
            continue
        copies, kernel = _C.split_engines(staged[r].rest_boxes(t.direct_boxes()), engine_bytes)
        staged[r].run_all()
        if deferred[r]:
            local()
        runs = pitched = 0
        for part in _C.spread_engines(copies, engine_streams):
            n_runs, n_pitched = run_engine(part)
            runs, pitched = runs + n_runs, pitched + n_pitched
        _C.copy_boxes_cpu(kernel)
        if stats is not None:
            stats["engine"] += len(copies)
            stats["kernel"] += len(kernel)
            stats["runs"] += runs
            stats["pitched"] += pitched
    late = [locals_[r] if deferred[r] else None for r in range(world)]
    check = _land(plans, splits, tables, refs, engine_bytes, staged, late) if landing else None
    for b in range(k):
        for r in range(world):
            tables[r].run_pack_cpu(b)
        for r in range(world):
            sends = tables[r].messages(b)[0]
            for q in sorted({m.peer for m in sends}):
                out = [(m.ptr, m.bytes) for m in sends if m.peer == q]
                into = [(m.ptr, m.bytes) for m in tables[q].messages(b)[1] if m.peer == r]
                assert [n for _, n in out] == [n for _, n in into], f"batch {b}: ranks {r}->{q} disagree on messages"
                for (sp, n), (dp, _) in zip(out, into):
                    ctypes.memmove(dp, sp, n)
            recvs = tables[r].messages(b)[1]
            for q in {m.peer for m in recvs}:
                assert any(m.peer == r for m in tables[q].messages(b)[0]), f"rank {r} waits for {q} in vain"
        for r in range(world):
            tables[r].run_unpack_cpu(b)
    if check is not None:
        check()
        for r in range(world):
            _check_staged_digests(plans[r], tables[r], refs[r], staged[r], peers_of(direct, r), stats)
    if stats is not None:
        stats["max_ahead"] = max((s.max_ahead for s in staged), default=0)
    for (_, src_steps), (_, dst_steps) in rewritten:
        for step in src_steps[1] + dst_steps[1]:
            step()

def _digests(plan: Any, bound: Any, refs: tuple) -> tuple:
    """(send, recv) digests of a rank's whole plan now: what each send op's source would
    send, what each recv op finds in its destination (`refs`: the tensors as bound to
    `bound`, the rank's split tables)."""
    import numpy as np

    whole = _C.ExecTables(plan)
    by_src, by_dst = dict(zip(bound.src_used, refs[0])), dict(zip(bound.dst_used, refs[1]))
    whole.bind([by_src[i] for i in whole.src_used], [by_dst[i] for i in whole.dst_used],
               [1 << 44] * max(1, whole.num_batches), [1 << 44] * max(1, whole.num_batches), 0)
    out = tuple(np.zeros(n, dtype=np.uint64) for n in whole.num_ops)
    whole.read_digests_cpu(*out, np.zeros_like(out[2]))
    return out[0], out[1]


def _recv_digests(plan: Any, bound: Any, refs: tuple) -> Any:
    return _digests(plan, bound, refs)[1]


def _check_staged_digests(plan: Any, bound: Any, refs: tuple, run: StagedRun, peers: list[int],
                          stats: dict | None) -> None:
    """A verified execute's staged send digests (read from the ring, folded per op as the
    transport folds them) equal the send digests of those ops read from their sources."""
    import numpy as np

    from reshard_ext.transports.digests import fold_into
    from reshard_ext.transports.direct import staged_send_rows

    order = [b for ch in run.chunks for b in ch[5]]
    if not order:
        return
    box_ops = bound.direct_ops()
    direct_sends = [i for i, op in enumerate(plan.sends()) if op.peer in set(peers)]
    rows, ops = staged_send_rows([box_ops[b] for b in order], box_ops, direct_sends)
    folded = np.zeros(len(plan.sends()), dtype=np.uint64)
    fold_into(torch.from_numpy(folded.view(np.int64)), torch.from_numpy(run.digests.view(np.int64)),
              torch.tensor(rows, dtype=torch.int64), torch.tensor(ops, dtype=torch.int64))
    want = _digests(plan, bound, refs)[0]
    assert ops and (folded[ops] == want[ops]).all(), (
        f"staged send digests differ from the sources' at ops {[o for o in ops if folded[o] != want[o]]}")
    if stats is not None:
        stats["digested_ops"] = stats.get("digested_ops", 0) + len(ops)


def _land(plans: list, splits: list, tables: list, refs: list, engine_bytes: int, staged: list,
          late: list | None = None) -> Any:
    """Runs every direct write in landing groups, each sender's staged chunks up to its
    signal of the group, then the group's other writes; returns the check to call after the
    refit. late[r]: rank r's same-rank copies, run after its first signal (its deferred work
    done: the executor's start waits for it)."""
    import numpy as np

    world, groups = len(plans), LANDING_GROUPS
    senders = [sorted({op.peer for op in splits[q].direct_recvs()}) for q in range(world)]
    runs = [_C.ExecTables(plans[q]).landing_runs(senders[q], groups) for q in range(world)]
    seen = [np.zeros(len(plans[q].recvs()), dtype=np.uint64) for q in range(world)]
    signals = [s.run() for s in staged]
    for g in range(groups):
        for r in range(world):
            if staged[r].plan.num_chunks:  # the signal waits for the deferred work too: the rest follow it
                assert next(signals[r]) == g, f"rank {r}: staged signals out of order"
            if g == 0 and late and late[r] is not None:
                late[r]()
            rest = staged[r].rest_boxes(tables[r].direct_boxes())
            of_rest = np.asarray(tables[r].direct_landing_groups(groups), dtype=np.int64)[staged[r].rest]
            copies, kernel = _C.split_engines(rest[of_rest == g].copy(), engine_bytes)
            run_engine(copies)
            _C.copy_boxes_cpu(kernel)
        for q in range(world):
            now = _recv_digests(plans[q], tables[q], refs[q])
            for a, b in runs[q][g]:
                seen[q][a:b] = now[a:b]
    for r, signal in enumerate(signals):
        assert next(signal, None) is None, f"rank {r}: a staged signal past the last landing group"

    def check() -> None:
        for q in range(world):
            final = _recv_digests(plans[q], tables[q], refs[q])
            for g in range(groups):
                for a, b in runs[q][g]:
                    assert (seen[q][a:b] == final[a:b]).all(), (
                        f"rank {q}: recv ops [{a}, {b}) expected in landing group {g} had not landed then")
    return check


def all_pairs(world: int) -> set[tuple[int, int]]:
    return {(a, b) for a in range(world) for b in range(a + 1, world)}


def make_entries(spec: dict, world: int, seed: int = 0) -> tuple[list[dict], list[dict], dict]:
    """Per-rank src (pieces of seeded logical tensors) and dst (poisoned) entries of a
    _cases spec, and the logical tensors."""
    from _cases import make_global, poison

    src: list[dict] = [{} for _ in range(world)]
    dst: list[dict] = [{} for _ in range(world)]
    logical = {}
    for i, (name, (shape, sdt, sl, ddt, dl)) in enumerate(sorted(spec.items())):
        g = make_global(shape, sdt, seed=seed + i)
        logical[name] = g
        for r in range(world):
            part = sl.local_part(g, r)
            if part is not None:
                src[r][name] = (part.clone(), sl)
            if r in dl.mesh:
                dst[r][name] = (poison(dl.local_shape(r), ddt, "cpu"), dl)
    return src, dst, logical
