"""The direct transport's tables, run in one process on CPU tensors (no process group, no
GPU): every rank's plan is split between direct pairs and "NCCL" pairs as the transport
splits it; direct boxes are bound to the receivers' own tensors (one address space, so
the peer mapping is the identity); copy-engine copies run as row memmoves, kernel boxes
through the CPU twin; NCCL pairs pack, exchange their messages by memmove and unpack.
What it checks is everything the transport decides on the host: which ops each side
keeps, the batch layout both ends of an NCCL pair share, the geometry of every direct
box and copy-engine copy, and the casts and MX modes they carry."""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from reshard_ext import _C
from reshard_ext.execution import _refs, _rewrite
from reshard_ext.options import Options
from reshard_ext.transports.direct import peers_of

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


def simulate(src: list[dict], dst: list[dict], direct: set[tuple[int, int]], engine_bytes: int = 1 << 20,
             max_batch_bytes: int = 0, transform: Any = None, stats: dict | None = None,
             local_engine_bytes: int | None = None, engine_streams: int = 1, landing: bool = False) -> None:
    """Runs one refit of per-rank entries {name: (tensor, layout)} (CPU tensors) with the
    pairs in `direct` (as (low, high) rank pairs) direct and the others over "NCCL".
    local_engine_bytes: the same-rank copies of ranks without "NCCL" pairs are split as
    DirectExec splits them (copy engine / kernel) instead of the inner transport's copy.
    engine_streams: the copy-engine copies are spread over that many streams first.
    landing: the direct writes run group by group (a verified execute's landing groups);
    each receiver digests the ops it expects in group k once every sender wrote group k,
    and each of those digests must equal the op's digest after the whole refit."""
    world = len(src)
    rewritten = [(_rewrite(transform, "src", src[r]), _rewrite(transform, "dst", dst[r])) for r in range(world)]
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
        tables[r].bind_direct(refs[r][0], pieces)
    if stats is not None:
        stats.update(batches=k, staging=[t.send_buffer_bytes + t.recv_buffer_bytes for t in tables],
                     direct_ops=[tuple(t.num_direct_ops) for t in tables], ops=[tuple(t.num_ops) for t in tables],
                     engine=0, kernel=0, runs=0, pitched=0, local_engine=0, local_kernel=0)
    for (_, src_steps), (_, dst_steps) in rewritten:  # steps: (before, after)
        for step in src_steps[0] + dst_steps[0]:
            step()
    for r in range(world):
        t = tables[r]
        if local_engine_bytes is None or t.send_total or t.recv_total:
            t.run_copies_cpu()
        else:
            copies, kernel = _C.split_engines(t.copy_boxes(), local_engine_bytes)
            run_engine(copies)
            _C.copy_boxes_cpu(kernel)
            if stats is not None:
                stats["local_engine"] += len(copies)
                stats["local_kernel"] += len(kernel)
        if landing:
            continue
        copies, kernel = _C.split_engines(t.direct_boxes(), engine_bytes)
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
    check = _land(plans, splits, tables, refs, engine_bytes) if landing else None
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
    for (_, src_steps), (_, dst_steps) in rewritten:
        for step in src_steps[1] + dst_steps[1]:
            step()


def _recv_digests(plan: Any, bound: Any, refs: tuple) -> Any:
    """Digests of what every recv op of a rank's whole plan finds in its destination now
    (`refs`: the tensors as bound to `bound`, the rank's split tables)."""
    import numpy as np

    whole = _C.ExecTables(plan)
    by_src, by_dst = dict(zip(bound.src_used, refs[0])), dict(zip(bound.dst_used, refs[1]))
    whole.bind([by_src[i] for i in whole.src_used], [by_dst[i] for i in whole.dst_used],
               [1 << 44] * max(1, whole.num_batches), [1 << 44] * max(1, whole.num_batches), 0)
    out = tuple(np.zeros(n, dtype=np.uint64) for n in whole.num_ops)
    whole.read_digests_cpu(*out, np.zeros_like(out[2]))
    return out[1]


def _land(plans: list, splits: list, tables: list, refs: list, engine_bytes: int) -> Any:
    """Runs every direct write in landing groups; returns the check to call after the refit."""
    import numpy as np

    world, groups = len(plans), LANDING_GROUPS
    senders = [sorted({op.peer for op in splits[q].direct_recvs()}) for q in range(world)]
    runs = [_C.ExecTables(plans[q]).landing_runs(senders[q], groups) for q in range(world)]
    seen = [np.zeros(len(plans[q].recvs()), dtype=np.uint64) for q in range(world)]
    for g in range(groups):
        for r in range(world):
            records = np.frombuffer(tables[r].direct_boxes(), dtype=np.uint8).reshape(-1, _C.BOX_BYTES)
            group = records[np.asarray(tables[r].direct_landing_groups(groups), dtype=np.int64) == g].copy()
            copies, kernel = _C.split_engines(group, engine_bytes)
            run_engine(copies)
            _C.copy_boxes_cpu(kernel)
        for q in range(world):
            now = _recv_digests(plans[q], tables[q], refs[q])
            for a, b in runs[q][g]:
                seen[q][a:b] = now[a:b]

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
