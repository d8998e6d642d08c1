"""The direct transport (peer-mapped writes, no staging; reshard_ext/transports/direct.py).

CPU: the pair selection, and every table the transport builds, run in one process by
_direct_sim (direct pairs, NCCL pairs and mixes of both, copy engines and kernel, casts
and MXFP8, a sender's codec boxes through the staging ring in every order its script
allows) against the logical tensors, bit for bit.
GPU (2 or 4 GPUs, skipped elsewhere): the refit matrix through backend="direct", pairs
falling back to NCCL, a peer that never executes, rebinding (MXFP8 over direct pairs:
test_mxfp8_refit.py::test_refit_matrix_cuda).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _cases import CASES, bits_equal, run_case
from _direct_sim import LANDING_GROUPS, all_pairs, make_entries, simulate
from _dist import gpus_for, own_gpus, run_ranks

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate, Shard
from reshard_ext.layout import code_of
from reshard_ext.transports.direct import RankInfo, agree, candidate_pairs, peers_of

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CUDA_BUILT = bool(rx.build_info()["cuda"])
needs2 = pytest.mark.skipif(not gpus_for(2) or not CUDA_BUILT, reason="needs 2 GPUs and reshard_ext built with CUDA")
needs4 = pytest.mark.skipif(not gpus_for(4) or not CUDA_BUILT, reason="needs 4 GPUs and reshard_ext built with CUDA")
F32, BF16 = torch.float32, torch.bfloat16


# --- pair selection (pure) ------------------------------------------------------------

def _info(host: str, pid: int, ok: bool = True) -> RankInfo:
    return RankInfo(host, pid, "", ((b"h" * 64), 0, 64) if ok else None, "/dev/shm/x" if ok else "")


def test_candidate_pairs_need_one_host_two_processes_and_both_willing():
    infos = [_info("a", 1), _info("a", 2), _info("a", 2), _info("b", 4), _info("a", 5, ok=False), _info("b", 6)]
    # 1 and 2 share a process (CUDA IPC cannot open its own handles); 4 opted out
    assert candidate_pairs(infos) == {(0, 1), (0, 2), (3, 5)}
    assert peers_of({(0, 1), (0, 2), (3, 5)}, 0) == [1, 2] and peers_of({(0, 1), (3, 5)}, 5) == [3]


def test_agree_unions_failures_and_raises_every_error():
    assert agree([([], {(0, 1)}), ([], {(1, 2)}), ([], set())]) == {(0, 1), (1, 2)}
    with pytest.raises(rx.ReshardError, match="rank 1: boom"):
        agree([([], set()), (["rank 1: boom"], set())])


# --- the transport's tables on CPU ------------------------------------------------------

def _pairs(mode: str, world: int) -> set[tuple[int, int]]:
    if mode == "all":
        return all_pairs(world)
    if mode == "none":
        return set()
    return {p for p in all_pairs(world) if (p[0] + p[1]) % 2}  # a mix: some pairs direct, the others NCCL


def _check(dst: list[dict], logical: dict) -> None:
    for r, entries in enumerate(dst):
        for name, (t, dl) in entries.items():
            want = dl.local_part(logical[name].to(dl.dtype), r)
            assert bits_equal(t, want), f"rank {r}: {name} differs"


@pytest.mark.parametrize("max_batch_bytes", [0, 512])
@pytest.mark.parametrize("engine_bytes", [0, 1])
@pytest.mark.parametrize("mode", ["all", "none", "mixed"])
@pytest.mark.parametrize("case,world", [("two", 2), ("tp", 4), ("uneven_blocks", 4), ("meshes", 4),
                                        ("pp_experts", 4), ("placement", 4), ("casts", 4)])
def test_tables_move_every_element(case, world, mode, engine_bytes, max_batch_bytes):
    src, dst, logical = make_entries(CASES[case](world), world, seed=100)
    stats: dict = {}
    simulate(src, dst, _pairs(mode, world), engine_bytes, max_batch_bytes, stats=stats)
    _check(dst, logical)
    if mode == "all":  # no staging, no batches, no pack or unpack
        assert stats["staging"] == [0] * world and stats["batches"] == 1, stats
        assert all(ops[:2] == (0, 0) for ops in stats["ops"]), stats
    if mode == "none":
        assert stats["direct_ops"] == [(0, 0)] * world, stats


@pytest.mark.parametrize("mode", ["all", "mixed"])
@pytest.mark.parametrize("case,world", [("two", 2), ("tp", 4), ("uneven_blocks", 4), ("pp_experts", 4),
                                        ("casts", 4), ("many_boxes", 4)])
def test_each_landing_group_is_whole_when_its_receiver_reads_it(case, world, mode):
    """A verified execute's senders write and signal their ops in landing groups, and each
    receiver digests group k once its senders signal it: both ends must cut a pair's ops
    alike (the senders' direct tables, the receiver's whole plan)."""
    src, dst, logical = make_entries(CASES[case](world), world, seed=100)
    simulate(src, dst, _pairs(mode, world), engine_bytes=1, landing=True)
    _check(dst, logical)


def test_landing_groups_halve_a_pairs_ops_by_elements():
    spec = {f"t{i}": ((8 * (i + 1), 64), F32, Layout((8 * (i + 1), 64), F32, Mesh([0, 1]), [Shard(1)]), F32,
                      Layout((8 * (i + 1), 64), F32, Mesh([1, 0]), [Replicate()])) for i in range(300)}
    layouts = ({n: v[2] for n, v in spec.items()}, {n: v[4] for n, v in spec.items()})
    plan = rx.local_plan(*layouts, 0)._c
    recvs = [op for op in plan.recvs()]
    runs = _C.ExecTables(plan).landing_runs([1], LANDING_GROUPS)
    assert len(runs) == LANDING_GROUPS + 1 and runs[-1] == []  # every peer is a direct sender here
    groups = [k for k, rs in enumerate(runs) for a, b in rs for _ in range(a, b)]
    assert groups == sorted(groups) and len(groups) == len(recvs)  # every op once, in plan order
    assert len(set(groups)) == LANDING_GROUPS  # 300 ops of growing size fill every group
    elements = [math.prod(op.size) for op in recvs]
    total, before = sum(elements), 0
    for k, n in zip(groups, elements):  # group k: what is left from the op's first element on is
        left = total - before           # at most 1 / 2^k of the pair's elements, more than 1 / 2^(k + 1)
        assert left <= total >> k and (k == LANDING_GROUPS - 1 or left > total >> (k + 1)), (k, left, total)
        before += n
    assert _C.ExecTables(plan).landing_runs([], LANDING_GROUPS)[-1] == [(0, len(recvs))]  # no direct sender


def _engine_spec(world: int) -> dict:
    """Boxes the copy engines take: TP column slices (2-D, rows of 1 KiB with pitch 2 KiB)
    and row slices (one contiguous run), and a cast and rows too narrow for them."""
    ranks = list(range(world))
    return {
        "col": ((64, 512), F32, Layout((64, 512), F32, Mesh(ranks), [Shard(1)]), F32,
                Layout((64, 512), F32, Mesh(ranks[::-1]), [Replicate()])),
        "row": ((64, 256), F32, Layout((64, 256), F32, Mesh(ranks), [Shard(0)]), F32,
                Layout((64, 256), F32, Mesh(ranks), [Replicate()])),
        "narrow": ((64, 32), F32, Layout((64, 32), F32, Mesh(ranks), [Shard(1)]), F32,
                   Layout((64, 32), F32, Mesh(ranks), [Replicate()])),
        "cast": ((64, 512), F32, Layout((64, 512), F32, Mesh(ranks), [Shard(1)]), BF16,
                 Layout((64, 512), BF16, Mesh(ranks), [Replicate()])),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_copies_are_exact(world):
    src, dst, logical = make_entries(_engine_spec(world), world, seed=7)
    stats: dict = {}
    simulate(src, dst, all_pairs(world), engine_bytes=1, stats=stats)
    _check(dst, logical)
    # per sender and receiver: col (2-D) and row (1-D) on the engines; narrow and cast in the kernel
    pairs = world * (world - 1)
    assert stats["engine"] == 2 * pairs and stats["kernel"] == 2 * pairs, stats


def test_split_engines_geometry():
    """A folded 2-D box becomes one cudaMemcpy2D; the threshold and the row width decide."""
    src, dst, _ = make_entries(_engine_spec(2), 2, seed=3)
    stats: dict = {}
    simulate(src, dst, all_pairs(2), engine_bytes=1 << 30, stats=stats)  # above every box: kernel only
    assert stats["engine"] == 0 and stats["kernel"] == 8, stats


def test_batch_engines_merges_runs_adjacent_on_both_sides():
    """Runs that continue each other on both sides become one copy; a run adjacent on one
    side only stays apart; pitched copies pass as they are, in order."""

    def run(dst: int, src: int, n: int) -> tuple:
        return (dst, n, src, n, n, 1)

    pitched = (5000, 64, 9000, 128, 64, 4)
    copies = [run(100, 1000, 16), run(116, 1016, 8), run(124, 1100, 8), pitched, run(200, 2000, 4),
              run(204, 2004, 4), run(300, 2008, 4)]
    runs, pitched_out = _C.batch_engines(copies)
    assert runs == [run(100, 1000, 24), run(124, 1100, 8), run(200, 2000, 8), run(300, 2008, 4)], runs
    assert pitched_out == [pitched]
    assert _C.batch_engines([]) == ([], [])
    # runs adjacent on both sides but across an allocation boundary (dst 116, src 2004) stay apart
    runs, _ = _C.batch_engines(copies, allocations=[0, 116, 2004])
    assert runs == [run(100, 1000, 16), run(116, 1016, 8), run(124, 1100, 8), run(200, 2000, 4), run(204, 2004, 4),
                    run(300, 2008, 4)], runs


def test_spread_engines_balances_bytes_and_cuts_at_rows():
    """Copies spread over n streams: every byte once, in order, total/n per stream; a
    pitched copy is cut at a row, a run at a byte."""
    pitched, run = (0, 100, 10_000, 200, 100, 30), (50_000, 3000, 60_000, 3000, 3000, 1)
    assert _C.spread_engines([pitched, run], 3) == [
        [(0, 100, 10_000, 200, 100, 20)],
        [(2000, 100, 14_000, 200, 100, 10), (50_000, 1000, 60_000, 1000, 1000, 1)],
        [(51_000, 2000, 61_000, 2000, 2000, 1)],
    ]
    assert _C.spread_engines([pitched, run], 1) == [[pitched, run]]
    assert _C.spread_engines([], 4) == [[], [], [], []]


def test_engine_streams_follow_the_number_of_copies_by_default():
    """n = 0 (the default): one stream per 100 copies, at least 4, at most 32; every copy
    kept, in order."""
    assert [_C.auto_engine_streams(n) for n in (0, 1, 229, 400, 401, 3053, 3200, 3201, 100_000)] == [
        4, 4, 4, 4, 5, 31, 32, 32, 32]
    copies = [(i * 4096, 4096, (1 << 30) + i * 4096, 4096, 4096, 1) for i in range(1000)]
    parts = _C.spread_engines(copies, 0)
    assert len(parts) == 10 and [c for part in parts for c in part] == copies
    assert rx.Options().resolved_direct_engine_streams() == 0
    assert rx.Options(tuning=rx.Tuning(direct_engine_streams=3)).resolved_direct_engine_streams() == 3


def _ring_boxes(n: int, size: int) -> tuple:
    """(table, src, dst, expected dst): n contiguous uint8 boxes of `size` bytes, then a box of
    4 rows of 600 B into rows 1000 B apart (a pitched copy once staged)."""
    from _boxes import table

    u8 = code_of(torch.uint8)
    src = torch.randint(0, 256, (n * size + 4 * 600,), dtype=torch.uint8)
    dst = torch.zeros(n * size + 4 * 1000, dtype=torch.uint8)
    rows = [(src.data_ptr() + i * size, dst.data_ptr() + i * size, (size,), (1,), (1,), u8, u8) for i in range(n)]
    rows.append((src.data_ptr() + n * size, dst.data_ptr() + n * size, (4, 600), (600, 1), (1000, 1), u8, u8))
    want = dst.clone()
    want[:n * size] = src[:n * size]
    want[n * size:].view(4, 1000)[:, :600] = src[n * size:].view(4, 600)
    return table(rows), src, dst, want


def test_plan_staging_fills_slots_group_by_group():
    """plan_staging: stageable boxes whose destination is one copy-engine copy and that fit a
    slot, chunked in landing-group order, each box at an aligned offset of its slot, row-major;
    the rest (not stageable, rows under 512 B, dims that do not fold, too big) left in order."""
    from _boxes import table

    u8, f32 = code_of(torch.uint8), code_of(torch.float32)
    boxes = table([
        (1 << 20, 9 << 20, (1000,), (1,), (1,), u8, u8),                # 0: group 1, a run
        (2 << 20, 10 << 20, (4, 150), (150, 1), (250, 1), f32, f32),     # 1: group 0, rows of 600 B, pitch 1000
        (3 << 20, 11 << 20, (4, 100), (100, 1), (200, 1), u8, u8),       # 2: rows of 100 B: no
        (4 << 20, 12 << 20, (1000,), (1,), (1,), u8, u8),                # 3: not stageable
        (5 << 20, 13 << 20, (5000,), (1,), (1,), u8, u8),                # 4: over a slot
        (6 << 20, 14 << 20, (2, 3, 512), (1536, 512, 1), (4096, 1024, 1), u8, u8),  # 5: three dims in dst
        (7 << 20, 15 << 20, (3000,), (1,), (1,), u8, u8),                # 6: group 0, a second chunk
    ])
    plan, rest = _C.plan_staging(boxes, [1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 1], 4096)
    assert rest == [2, 3, 4, 5], rest
    chunks = [plan.chunk(c) for c in range(plan.num_chunks)]
    assert [(g, slot, nbytes, ids) for g, slot, nbytes, _, _, ids, _ in chunks] == [
        (0, 0, 2560, [1]), (0, 1, 3072, [6]), (1, 2, 1024, [0])], chunks
    assert plan.slots == 3 and plan.slot_bytes == 3072 and plan.ring_bytes == 9216
    plan.relocate(1 << 30)
    _, _, _, pack, copies, _, digest = plan.chunk(0)
    assert copies == [(10 << 20, 1000, 1 << 30, 600, 600, 4)]  # (dst, dpitch, src, spitch, width, height)
    assert plan.chunk(2)[4] == [(9 << 20, 1000, (1 << 30) + 2 * 3072, 1000, 1000, 1)]
    from _boxes import BOX

    rec = np.frombuffer(pack, dtype=BOX)[0]
    assert rec["dst"] == 1 << 30 and list(rec["dst_stride"][:2]) == [150, 1] and rec["src"] == 2 << 20
    # its digest box: the slot's bytes read as a plain copy of the dst dtype, ordinals from 0 here
    rec = np.frombuffer(digest, dtype=BOX)[0]
    assert rec["src"] == rec["dst"] == 1 << 30 and list(rec["src_stride"][:2]) == [150, 1], rec
    assert rec["codec"] == 0 and rec["src_dtype"] == rec["dst_dtype"] == f32 and rec["param"][0] == 0, rec
    plan, _ = _C.plan_staging(boxes, [1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 1], 4096, [7, 5, 0, 0, 0, 0, 9], 2)
    assert plan.slots == 2 and [plan.chunk(c)[1] for c in range(3)] == [0, 1, 0]  # two slots, reused
    assert [np.frombuffer(plan.chunk(c)[6], dtype=BOX)[0]["param"][0] for c in range(3)] == [5, 9, 7]
    assert _C.plan_staging(boxes, [], [1] * 7, 0)[1] == list(range(7))  # no slot: nothing staged


@pytest.mark.parametrize("landing", [0, 3])
@pytest.mark.parametrize("policy", ["pack", "copy", 0, 1, 2])
def test_staging_script_runs_the_ring_in_any_allowed_order(policy, landing):
    """A ring of 4 slots for 12 chunks: each chunk packed into a free slot and copied out
    once, whatever order the streams run in; each landing group whole when signalled."""
    from _direct_sim import StagedRun

    boxes, _, dst, want = _ring_boxes(30, 700)
    run = StagedRun(boxes, [min(i // 11, 2) for i in range(31)], [1] * 31, 2560, landing, policy)
    assert run.plan.num_chunks == 12 and run.plan.slots == _C.STAGE_SLOTS and run.rest == []
    parts = list(run.run()) if landing else (run.run_all() or [0])
    assert parts == (list(range(landing)) if landing else [0]), parts
    assert torch.equal(dst, want)


@pytest.mark.parametrize("broken,policy,landing,error", [
    ("slot", "pack", 0, "packed into slot"),                # the pack of chunk c + 4 waits for c's copy
    ("packed", "copy", 0, "copied out of slot"),            # a copy waits for its chunk's pack
    ("end", "pack", 3, "signalled before chunks"),          # a signal waits for its group's copies
    ("digest", "copy", 3, "digested from slot"),            # a chunk's digest reads its slot before the next pack
])
def test_the_staging_emulation_catches_a_script_without_its_waits(broken, policy, landing, error):
    """The emulation is no rubber stamp: a script missing one kind of wait fails it."""
    from _direct_sim import _DIGEST, _RECORD, _WAIT, StagedRun

    def edit(streams, events, prefill, parts):
        slots = (events - streams) // 2

        def keep(a):
            op, stream, arg = a
            if broken == "slot":
                return not (op == _WAIT and stream == 0 and slots <= arg < 2 * slots)
            if broken == "packed":
                return not (op == _WAIT and stream > 0 and 0 <= arg < slots)
            if broken == "digest":  # every digest moved behind the last pack
                return op != _DIGEST
            return not (op == _RECORD and 2 * slots <= arg < 2 * slots + streams)
        late = [a for p in [prefill] + parts for a in p if a[0] == _DIGEST] if broken == "digest" else []
        parts = [[a for a in p if keep(a)] for p in parts]
        parts[-1] = late + parts[-1]
        return streams, events, [a for a in prefill if keep(a)], parts

    boxes, *_ = _ring_boxes(30, 700)
    run = StagedRun(boxes, [min(i // 11, 2) for i in range(31)], [1] * 31, 2560, landing, policy, edit)
    with pytest.raises(AssertionError, match=error):
        run.run_all()


def _carved(entries: list[dict]) -> list[dict]:
    """The same entries, each rank's tensors moved (values kept) into one buffer in name
    order, as a caching allocator places tensors allocated one after another."""
    out = []
    for rank_entries in entries:
        names = sorted(rank_entries)
        sizes = [rank_entries[n][0].numel() * rank_entries[n][0].element_size() for n in names]
        buf = torch.empty(sum(-(-b // 16) * 16 for b in sizes), dtype=torch.uint8)
        carved, at = {}, 0
        for n, b in zip(names, sizes):
            t, layout = rank_entries[n]
            view = buf[at:at + b].view(t.dtype).view(t.shape) if b else t.clone()
            view.copy_(t)
            carved[n] = (view, layout)
            at += -(-b // 16) * 16
        out.append(carved)
    return out


@pytest.mark.parametrize("engine_streams", [1, 3])
@pytest.mark.parametrize("local_engine_bytes", [0, 1, 4096])
@pytest.mark.parametrize("engine_bytes", [0, 1, 4096])
@pytest.mark.parametrize("world", [2, 4])
def test_many_boxes_every_path_is_exact(world, engine_bytes, local_engine_bytes, engine_streams):
    """Hundreds of boxes over the copy engines (batched, adjacent runs merged), the kernel
    and the same-rank split of DirectExec, mixed by the thresholds, bit for bit."""
    src, dst, logical = make_entries(CASES["many_boxes"](world), world, seed=11)
    src, dst = _carved(src), _carved(dst)
    stats: dict = {}
    simulate(src, dst, all_pairs(world), engine_bytes, stats=stats, local_engine_bytes=local_engine_bytes,
             engine_streams=engine_streams)
    _check(dst, logical)
    assert stats["kernel"] > 0, stats  # casts always take the kernel
    assert (stats["engine"] > 0) == (engine_bytes > 0) and (stats["local_engine"] > 0) == (local_engine_bytes > 0)
    assert stats["local_kernel"] > 0, stats
    if engine_bytes == 1 and engine_streams == 1:  # a rank's consecutive experts land adjacent: fewer runs
        assert stats["runs"] < stats["engine"] - stats["pitched"], stats


def _wide_rows(world: int) -> dict:
    """MXFP8 cases whose direct boxes write FP8 rows of >= 512 B with a pitch (a TP column
    slice into a wider destination: a pitched copy-engine copy once staged) or one run."""
    ranks = list(range(world))
    return {"wide.col": (Layout((24, 2048), BF16, Mesh(ranks), [Shard(1)]),
                         Layout((24, 2048), BF16, Mesh(ranks[::-1]), [Replicate()])),
            "wide.row": (Layout((40, 1024), BF16, Mesh(ranks), [Shard(0)]),
                         Layout((40, 1024), BF16, Mesh(ranks[1:] + ranks[:1]), [Shard(0)]))}


def _mxfp8_direct(mode: str, where: str, layout_kind: str, world: int, wide: bool = False, **sim: object) -> dict:
    """MXFP8 refit of the test_mxfp8_refit cases (and _wide_rows) through simulate: checks every
    destination byte against quantizing the logical tensor; returns simulate's stats."""
    from test_mxfp8_kernels import assert_bytes_equal, ref_mxfp8, ref_swizzle
    from test_mxfp8_refit import _global, _poison, cases

    from reshard_ext.mxfp8 import MXFP8, data_layout, scale_layout

    specs = cases(world, where) | (_wide_rows(world) if wide else {})
    names = sorted(specs)
    transform = MXFP8(params=names, scale_layout=layout_kind, where=where)
    logical = {n: _global(n, specs[n][0].shape, 0) for n in names}
    src: list[dict] = [{} for _ in range(world)]
    dst: list[dict] = [{} for _ in range(world)]
    for r in range(world):
        for n in names:
            sl, dl = specs[n]
            if r in sl.mesh:
                src[r][n] = (sl.local_part(logical[n], r).to(sl.dtype), sl)
            if r in dl.mesh:
                local = dl.local_shape(r)
                data = _poison(math.prod(local), n + "data").view(torch.float8_e4m3fn).view(local)
                scols = -(-local[-1] // 32)
                scale = (_poison(math.prod(local[:-1]) * scols, n).view(local[:-1] + (scols,)) if layout_kind == "2d"
                         else _poison(_scale_numel(local), n))
                dst[r][n] = ((data, scale), dl)
    stats: dict = {}
    simulate(src, dst, _pairs(mode, world), engine_bytes=1, transform=transform, stats=stats, **sim)  # type: ignore[arg-type]
    for r in range(world):
        for n, ((data, scale), dl) in dst[r].items():
            want_d, want_s = ref_mxfp8(logical[n], "ceil", "2d")
            assert_bytes_equal(data.view(torch.uint8), data_layout(dl).with_dtype(torch.uint8).local_part(want_d, r),
                               f"rank {r} {n} data")
            piece = scale_layout(n, dl).local_part(want_s, r)
            if layout_kind == "swizzled":
                piece = ref_swizzle(piece.reshape(-1, piece.shape[-1]))
            assert_bytes_equal(scale, piece, f"rank {r} {n} scale")
    return stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
@pytest.mark.parametrize("mode", ["all", "mixed"])
def test_mxfp8_through_direct_boxes(mode, where, layout_kind, world):
    """MXFP8 on the direct path, byte for byte: the sender's boxes quantize while they
    write into the receiver (sender side, staging off), or write BF16-read blocks straight
    into the receiver's (data, scale) buffers (receiver side; an FP32 source is staged)."""
    stats = _mxfp8_direct(mode, where, layout_kind, world)
    assert stats["staged"] == 0, stats


@pytest.mark.parametrize("stage_bytes,landing,policy", [(256, False, "pack"), (256, True, "pack"), (256, False, "copy"),
                                                       (256, True, 5), (2048, True, "copy"), (1 << 20, False, 5)])
@pytest.mark.parametrize("layout_kind,world", [("2d", 2), ("swizzled", 4)])
def test_mxfp8_sender_staged_through_the_ring(layout_kind, world, stage_bytes, landing, policy):
    """Sender-side MXFP8 on the direct path with a staging ring: the sender's codec boxes
    quantize into slots and the copy engines carry them on, chunk by chunk, in any order the
    staging script allows (StagedRun's policies), each landing group whole when signalled:
    byte for byte as quantizing the logical tensor, every slot within stage_bytes, ops cut
    to fit small slots, pitched and contiguous destinations alike."""
    stats = _mxfp8_direct("all", "sender", layout_kind, world, wide=True, stage_bytes=stage_bytes, landing=landing,
                          policy=policy)
    assert stats["staged"] > 0 and all(s <= stage_bytes for s in stats["slot"]), stats
    assert all(r <= _C.STAGE_SLOTS * stage_bytes for r in stats["ring"]), stats
    if stage_bytes == 256:  # many chunks: the ring wraps, and the pack runs ahead by every slot
        assert stats["chunks"] > 4 * _C.STAGE_SLOTS and stats["direct_boxes"] > stats["staged"] // 2, stats
        if policy == "pack":
            assert stats["max_ahead"] == _C.STAGE_SLOTS, stats


def test_staging_slots_stay_within_max_batch_bytes():
    """The ring (4 aligned slots) takes rx.Options.direct_staging_bytes, or what max_batch_bytes
    leaves beside the NCCL pairs' batches when that is less; too little for 4 slots: none."""
    from reshard_ext.transports.direct import stage_slot_bytes

    assert _C.STAGE_SLOTS == 4 and _C.STAGE_ALIGN == 256
    assert stage_slot_bytes(256 << 20, None, 1 << 30) == 64 << 20
    assert stage_slot_bytes(256 << 20, 1 << 20, 0) == 256 << 10
    assert stage_slot_bytes(256 << 20, 10_000, 2000) == 1792  # 8000 B left: 2000 per slot, aligned down
    assert stage_slot_bytes(256 << 20, 1 << 20, (1 << 20) - 1000) == 0
    assert stage_slot_bytes(256 << 20, 1000, 2000) == 0 and stage_slot_bytes(0, None, 0) == 0
    assert rx.Options().resolved_direct_staging_bytes() == 256 << 20


def test_receiver_side_codec_boxes_are_never_staged():
    """A receiver-side conversion writes its scales through a side buffer: its direct boxes
    are not stageable and keep writing into the peer (same bytes either way)."""
    stats = _mxfp8_direct("all", "receiver", "swizzled", 2, wide=True, stage_bytes=1 << 20)
    assert stats["staged"] == 0 and stats["ring"] == [0, 0], stats


def _scale_numel(local: tuple) -> int:
    from reshard_ext.mxfp8 import scale_numel

    return scale_numel(local, "swizzled")


# --- the transport over real process groups, with a CPU stand-in for the device ----------

def _fake_refit(rank, world, case, max_batch_bytes, engine_bytes=1, optout=-1, unshared=-1, refuse=(), groups=None):
    """run_case over backend="direct" on FakeDevice: rank `optout` maps nothing, rank
    `unshared`'s destinations cannot be exported, rank refuse[0] cannot attach refuse[1];
    groups: rx.Options.direct_verify_groups."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device({refuse[1]} if refuse and rank == refuse[0] else set())
    options = rx.Options(direct_ipc=rank != optout,
                         tuning=rx.Tuning(direct_engine_bytes=engine_bytes, direct_verify_groups=groups))
    try:
        kw = {} if rank == unshared else {"alloc": shared_poison}
        return run_case(rank, world, case, "cpu", max_batch_bytes, "direct", options, _pairs_of, **kw)
    finally:
        release_shared()


@pytest.mark.parametrize("max_batch_bytes", [None, 1024])
@pytest.mark.parametrize("case,world", [("two", 2), ("casts", 2), ("tp", 4), ("meshes", 4), ("pp_experts", 4),
                                        ("placement", 4)])
def test_transport_every_pair_direct(case, world, max_batch_bytes):
    for rank, (direct, nccl, staging, _) in enumerate(run_ranks(world, _fake_refit, case, max_batch_bytes)):
        assert direct == [r for r in range(world) if r != rank] and nccl == [] and staging == 0, (rank, direct, nccl)


@pytest.mark.parametrize("case", ["tp", "meshes", "pp_experts"])
def test_transport_rank_that_opts_out_uses_the_other_transport(case):
    """Rank 3 maps nothing: its pairs move over the other transport, on both ends, in one plan."""
    for rank, (direct, nccl, _, _) in enumerate(run_ranks(4, _fake_refit, case, 1024, 1, 3)):
        if rank == 3:
            assert direct == [] and nccl, nccl
        else:
            assert direct == [r for r in range(3) if r != rank] and set(nccl) <= {3}, (rank, direct, nccl)


def test_transport_unshareable_destinations_fall_back():
    """Rank 1's destinations cannot be exported: the pairs that write into rank 1 fall back
    (on both ends), the other pairs stay direct."""
    spec = CASES["tp"](4)
    into_1 = {op.peer for op in rx.local_plan({n: v[2] for n, v in spec.items()}, {n: v[4] for n, v in spec.items()},
                                              1).recvs if op.peer != 1}
    assert into_1 and into_1 != {0, 2, 3}  # some pairs of rank 1 fall back, some do not
    got = run_ranks(4, _fake_refit, "tp", 1024, 1, -1, 1)
    assert got[1][0] == sorted({0, 2, 3} - into_1) and got[1][1] == sorted(into_1), got[1]
    for rank in (0, 2, 3):
        direct, nccl, _, _ = got[rank]
        assert (1 in nccl) == (rank in into_1) and (1 in direct) == (rank not in into_1), (rank, got[rank])


def test_transport_unattachable_signals_fall_back():
    for rank, (direct, nccl, _, _) in enumerate(run_ranks(2, _fake_refit, "tp", None, 1, -1, -1, (0, 1))):
        assert direct == [] and nccl == [1 - rank], (rank, direct, nccl)


def _paths_of(plan) -> tuple:
    t = plan.transport
    ex = t.exec
    if ex is None:
        return None
    return (t.owns_copies, ex.num_engine_copies, ex.num_kernel_boxes, ex.num_local_engine_copies,
            ex.num_local_kernel_boxes, t.nccl_peers)


def _fake_paths(rank, world, options, optout=-1):
    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device()
    if rank == optout:
        options = options.replace(direct_ipc=False)
    try:
        return run_case(rank, world, "many_boxes", "cpu", None, "direct", options, _paths_of, alloc=shared_poison)
    finally:
        release_shared()


@pytest.mark.parametrize("local_engine_bytes", [0, 1])
@pytest.mark.parametrize("engine_bytes", [0, 4096])
def test_transport_runs_same_rank_copies_beside_direct_writes(engine_bytes, local_engine_bytes):
    """A rank whose peers are all direct hands its same-rank copies to the executor (split
    between a copy engine and the kernel); the refit stays exact over two executes."""
    options = rx.Options(tuning=rx.Tuning(direct_engine_bytes=engine_bytes,
                                          direct_local_engine_bytes=local_engine_bytes))
    for own, engine, kernel, local_engine, local_kernel, nccl in run_ranks(2, _fake_paths, options):
        assert own and nccl == [] and kernel > 0 and local_kernel > 0
        assert (engine > 0) == (engine_bytes > 0) and (local_engine > 0) == (local_engine_bytes > 0)


def _peerless(rank: int, world: int):
    """A direct plan in which every rank only copies its own shard: executes exchange no headers."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    from reshard_ext.transports import direct

    use_fake_device()
    layout = Layout((8 * world, 4), torch.float32, Mesh(list(range(world))), [Shard(0)])
    src = torch.arange(32.0) + 100 * rank
    dst = shared_poison((8, 4), torch.float32)
    calls = []
    original = direct.exchange_headers
    direct.exchange_headers = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        p = rx.plan({"w": (src.view(8, 4), layout)}, {"w": (dst, layout)}, backend="direct")
        for version in (1, 2):
            rx.execute(p, version=version)
        return p.transport.peers, len(calls), p.version, bits_equal(dst.flatten(), src)
    finally:
        direct.exchange_headers = original
        release_shared()


def test_a_rank_without_peers_exchanges_no_headers():
    """Only same-rank copies: nobody to agree with, so no header round trip delays them."""
    for peers, headers, version, ok in run_ranks(2, _peerless):
        assert peers == [] and headers == 0 and version == 2 and ok


def test_transport_ranks_with_nccl_pairs_keep_their_copies():
    """Rank 3 opts out: every rank then has a pair over the other transport, which keeps
    running the same-rank copies under its batches."""
    options = rx.Options(relay=False, tuning=rx.Tuning(direct_local_engine_bytes=1))  # one plan, not a relay's two
    for rank, got in enumerate(run_ranks(4, _fake_paths, options, 3)):
        if rank == 3:
            assert got is None, got
        else:
            own, _, _, local_engine, local_kernel, nccl = got
            assert not own and nccl == [3] and local_engine == local_kernel == 0, (rank, got)


_SL = Layout((64, 512), F32, Mesh([0, 1]), [Shard(1)])  # columns -> rows: each rank sends half to the other
_DL = Layout((64, 512), F32, Mesh([1, 0]), [Shard(0)])


def _fake_pair_plan(rank, seed, **plan_kw):
    """A direct plan of 2 ranks on FakeDevice (call release_shared() after): (plan, the
    sources, the destination, the logical tensor)."""
    from _direct_fake import shared_poison, use_fake_device

    use_fake_device()
    g = torch.randn(64, 512, generator=torch.Generator().manual_seed(seed))
    src = {"w": (_SL.local_part(g, rank).clone(), _SL)}
    out = shared_poison(_DL.local_shape(rank), F32)
    return rx.plan(src, {"w": (out, _DL)}, backend="direct", **plan_kw), src, out, g


def _fake_rebind(rank, world, bad_rank):
    """Every rank rebinds its destinations onto new shared tensors (each a sender and a
    receiver of the other: the new exports cross both ways); then a rebind that is wrong on
    `bad_rank` raises there alone, and with collective=True on every rank (none left waiting)."""
    from _direct_fake import release_shared, shared_poison

    dl = _DL
    try:
        p, src, old, g = _fake_pair_plan(rank, 2)
        rx.execute(p)
        ok = [bits_equal(old, dl.local_part(g, rank))]
        new = shared_poison(dl.local_shape(rank), F32)
        keep = old.clone()
        p.rebind(dst={"w": (new, dl)})
        src["w"][0].mul_(2)
        rx.execute(p)
        ok += [bits_equal(new, dl.local_part(g * 2, rank)), bits_equal(old, keep), p.transport.direct_peers]
        bad = torch.zeros(3, 3) if rank == bad_rank else new
        for collective in (False, True):
            try:
                p.rebind(dst={"w": (bad, dl)}, collective=collective)
                ok.append("no error")
            except rx.ReshardError as e:
                ok.append(str(e))
        return ok
    finally:
        release_shared()


def test_transport_rebind_is_local_unless_asked():
    for rank, ok in enumerate(run_ranks(2, _fake_rebind, 1)):
        assert ok[:4] == [True, True, True, [1 - rank]], ok
        assert ok[4] == "no error" if rank == 0 else "rank 1" in ok[4] and "(3, 3)" in ok[4], ok[4]
        assert "rank 1" in ok[5] and "(3, 3)" in ok[5], ok[5]


def _rebind_alone(rank, world):
    """Rank 1 calls plan.rebind(collective=True) alone while rank 0 executes: both raise
    within the reshard timeout, not the process group's."""
    import time

    from _direct_fake import release_shared, shared_poison

    try:
        p, _, _, _ = _fake_pair_plan(rank, 3, options=rx.Options(timeout=3))
        rx.execute(p)
        t0 = time.monotonic()
        try:
            if rank == 1:
                p.rebind(dst={"w": (shared_poison(_DL.local_shape(rank), F32), _DL)}, collective=True)
            else:
                rx.execute(p)
            return "no error", time.monotonic() - t0
        except rx.ReshardError as e:
            return str(e), time.monotonic() - t0
    finally:
        release_shared()


def test_a_rank_that_rebinds_collectively_alone_raises_within_the_timeout():
    from _dist import close_pool

    try:
        (executed, t_exec), (rebound, t_rebind) = run_ranks(2, _rebind_alone)
    finally:
        close_pool(2)  # rank 1's given-up gather stays posted in its group: the next test gets fresh ranks
    assert "rank 1" in executed and "did not call rx.execute" in executed and t_exec < 20, (executed, t_exec)
    assert "collective" in rebound and "within 3 s" in rebound and t_rebind < 20, (rebound, t_rebind)


class _Refused:
    """An IPC mapping that failed to open (as IpcMapping reports it)."""

    ok, base, why = False, 0, "refused by the test"


def _counting(transport) -> tuple[dict, object]:
    """Counts `transport`'s IPC exports and opens and its channel's remap messages;
    returns (the counts, a function that stops counting the messages)."""
    from reshard_ext.transports.channel import REMAP_TAG

    counts = {"export": 0, "open": 0, "remap": 0}
    dev, ch = transport.device, transport.channel

    def counted(key, f):
        def call(*args, **kw):
            counts[key] += 1
            return f(*args, **kw)
        return call

    dev.export, dev.open = counted("export", dev.export), counted("open", dev.open)
    exchange = ch.exchange

    def exchange_counted(ops, tag, *args, **kw):
        counts["remap"] += tag == REMAP_TAG
        return exchange(ops, tag, *args, **kw)

    ch.exchange = exchange_counted  # the channel outlives the plan: undone by the caller
    return counts, lambda: ch.__dict__.pop("exchange", None)


def _rebind_one(rank, world, who, side, cuda, refuse=""):
    """Rank `who` alone rebinds its `side` ("src" or "dst") of a direct plan in which each
    rank writes half of 'w' into the other; then three executes with new source values.
    refuse="open": the other rank cannot map what `who` rebound; once both raised, every
    rank calls plan.rebind(collective=True) and the pair moves over the other transport.
    refuse="executor": the other rank maps it but fails to rebuild its writes (out of
    memory, say) until the collective rebind, which keeps the pair direct.
    Returns ([per execute: the error, or (dst bit for bit, counts of that execute)],
    counts of the rebind, old dst untouched, old source never read, direct peers at the end)."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    dev = "cuda" if cuda else "cpu"

    def alloc(shape):  # destinations: memory the peer can map
        return torch.full(shape, float("nan"), device="cuda") if cuda else shared_poison(shape, F32)

    if not cuda:
        use_fake_device()
    undo = None
    try:
        g = torch.randn(64, 512, generator=torch.Generator().manual_seed(6))
        src = {"w": (_SL.local_part(g, rank).to(dev), _SL)}
        old = dst = alloc(_DL.local_shape(rank))
        p = rx.plan(src, {"w": (old, _DL)}, backend="direct", options=rx.Options(timeout=30))
        counts, undo = _counting(p.transport)
        rx.execute(p)
        kept, old_src = old.clone(), src["w"][0]
        before = dict(counts)
        if who in (rank, "every") and side == "dst":
            dst = alloc(_DL.local_shape(rank))
            p.rebind(dst={"w": (dst, _DL)})
        elif who in (rank, "every"):
            src = {"w": (old_src.clone(), _SL)}
            p.rebind(src=src)
            old_src.fill_(float("nan"))  # a direct write that still read it would show
        rebind = {k: counts[k] - before[k] for k in counts}
        device = p.transport.device
        if refuse == "open" and rank != who:
            device.open = lambda handle: _Refused()
        elif refuse == "executor" and rank != who:
            device.executor = lambda *args: (_ for _ in ()).throw(RuntimeError("no memory for the tables (test)"))
        out: list = []
        for i in range(2, 5):
            src["w"][0].copy_(_SL.local_part(g * i, rank))
            before = dict(counts)
            try:
                rx.execute(p)
            except rx.ReshardError as e:
                out.append(str(e))
                device.__dict__.pop("executor", None)
                p.rebind(collective=True)  # every rank, as the error says
                continue
            if cuda:
                torch.cuda.synchronize()
            out.append((bits_equal(dst.cpu(), _DL.local_part(g * i, rank)), {k: counts[k] - before[k] for k in counts}))
        return out, rebind, dst is old or bits_equal(old.cpu(), kept.cpu()), old_src is src["w"][0] or bool(
            old_src.isnan().all()), p.transport.direct_peers
    finally:
        if undo is not None:
            undo()
        if not cuda:
            release_shared()


def _check_rebind_one(got, who, side):
    quiet = {"export": 0, "open": 0, "remap": 0}
    for rank, (out, rebind, old_untouched, old_src_unread, direct) in enumerate(got):
        assert direct == [1 - rank] and old_untouched and old_src_unread, (rank, got[rank])
        assert all(ok for ok, _ in out), (rank, out)
        # the receiver exports at rebind and hands the exports over in the first execute
        # only (two messages: the exports, the answer); later executes pay nothing
        first = {"export": 0, "open": int(side == "dst" and rank != who), "remap": 2 * (side == "dst")}
        assert [n for _, n in out] == [first, quiet, quiet], (rank, out)
        assert rebind == {"export": int(rank == who), "open": 0, "remap": 0}, (rank, rebind)


@pytest.mark.parametrize("side", ["dst", "src"])
def test_a_rank_rebinds_a_direct_plan_alone(side):
    """plan.rebind is local with direct pairs: rank 1 alone rebinds its destinations (rank
    0 maps the new ones in the next execute) or its sources; every execute lands bit for
    bit, the old destination stays untouched and the old source unread."""
    _check_rebind_one(run_ranks(2, _rebind_one, 1, side, False), 1, side)


def test_every_rank_rebinds_its_destinations_alone():
    """Both ranks of a direct pair rebind their destinations, each alone: their headers
    match field for field (same plan, execute, remap size), and each must still hand its
    new exports to the other."""
    for rank, (out, _, old_untouched, _, direct) in enumerate(run_ranks(2, _rebind_one, "every", "dst", False)):
        assert direct == [1 - rank] and old_untouched, (rank, direct, old_untouched)
        assert all(isinstance(o, tuple) and o[0] for o in out), (rank, out)
        assert out[0][1]["open"] == 1 and out[1][1]["open"] == out[2][1]["open"] == 0, (rank, out)


def _lay(r):
    return Layout((32, 64), F32, Mesh([r]), [Replicate()])


def _whole_moves(rank, moves, alloc):
    """Whole (32, 64) tensors, name -> (source rank, destination rank): (the logical
    tensors, this rank's sources, its destinations allocated by `alloc`)."""
    g = {n: torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(moves)}
    src = {n: (g[n].clone(), _lay(s)) for n, (s, _) in moves.items() if s == rank}
    dst = {n: (alloc((32, 64), F32), _lay(d)) for n, (_, d) in moves.items() if d == rank}
    return g, src, dst


def _rebind_some(rank, world):
    """Rank 1 receives 'a' from rank 0 and 'b' from rank 2 (direct pairs) and 'c' from rank
    3 (which maps nothing: the other transport), and sends 'd' to rank 0; it alone rebinds
    'a'. Returns ([per execute after the rebind: (every dst bit for bit, counts)], the
    old 'a' untouched, direct peers)."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device()
    g, src, dst = _whole_moves(rank, {"a": (0, 1), "b": (2, 1), "c": (3, 1), "d": (1, 0)}, shared_poison)
    try:
        p = rx.plan(src, dst, backend="direct", options=rx.Options(direct_ipc=rank != 3, timeout=30))
        counts, undo = _counting(p.transport)
        rx.execute(p)
        old = dst.get("a", (torch.zeros(()),))[0]
        kept = old.clone()
        if rank == 1:
            dst = {**dst, "a": (shared_poison((32, 64), F32), _lay(1))}
            p.rebind(dst=dst)
        out = []
        for i in (2, 3):
            for n, (t, _) in src.items():
                t.copy_(g[n] * i)
            before = dict(counts)
            rx.execute(p)
            out.append((all(bits_equal(t, g[n] * i) for n, (t, _) in dst.items()),
                        {k: counts[k] - before[k] for k in counts}))
        undo()
        return out, bits_equal(old, kept), p.transport.direct_peers
    finally:
        release_shared()


def test_one_of_several_senders_remaps():
    """Only rank 0 maps rank 1's rebound 'a'; rank 2 (whose 'b' did not change) gets the
    handover message but opens nothing; both then hear that rank 1 takes part (three
    messages: it has two direct peers); rank 3's pair uses the other transport and hears
    nothing; the next execute is quiet everywhere."""
    got = run_ranks(4, _rebind_some)
    quiet = {"export": 0, "open": 0, "remap": 0}
    first = [{"export": 0, "open": 1, "remap": 3}, {"export": 0, "open": 0, "remap": 3},
             {"export": 0, "open": 0, "remap": 3}, quiet]
    for rank, (out, untouched, direct) in enumerate(got):
        assert [ok for ok, _ in out] == [True, True] and untouched, (rank, got[rank])
        assert [n for _, n in out] == [first[rank], quiet], (rank, out)
        assert direct == ([] if rank == 3 else [r for r in (0, 1, 2) if r != rank]), (rank, direct)


def _check_refused(got, refuse):
    for rank, (out, _, old_untouched, _, direct) in enumerate(got):
        err = out[0]
        assert isinstance(err, str) and "plan.rebind(collective=True) on every rank" in err, (rank, err)
        if refuse == "open":
            assert "rank 0 cannot map the destination tensors ['w'] that rank 1 rebound" in err, (rank, err)
        else:
            assert "rank 0: rebuilding its direct writes onto rebound destinations failed" in err, (rank, err)
        why = "refused by the test" if refuse == "open" else "no memory for the tables (test)"
        assert why in err and "see the error on rank" not in err, (rank, err)  # one answer, each cause once
        assert all(ok for ok, _ in out[1:]) and old_untouched, (rank, got[rank])
        assert direct == ([] if refuse == "open" else [1 - rank]), (rank, direct)


@pytest.mark.parametrize("refuse", ["open", "executor"])
def test_a_sender_that_cannot_map_rebound_destinations_raises_on_both_ranks(refuse):
    """Rank 0 cannot map rank 1's rebound destination, or cannot rebuild its writes onto
    it: both raise naming it (no data moves, no waiting for a timeout); a collective rebind
    rebuilds the plan (the pair over the other transport when the mapping still fails) and
    the refit lands."""
    _check_refused(run_ranks(2, _rebind_one, 1, "dst", False, refuse), refuse)


def _one_sender_refuses(rank, world):
    """Ranks 0 and 2 write 'a' and 'b' directly into rank 1, which writes 'd' into rank 3;
    rank 1 alone rebinds 'a' and 'b', and rank 2 cannot map the new 'b'. Returns (the
    execute's error and seconds, rank 1's old and new 'a' and 'b' and rank 3's 'd'
    untouched, then after plan.rebind(collective=True) on every rank: every dst bit for
    bit and the direct peers)."""
    import time

    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device()
    g, src, dst = _whole_moves(rank, {"a": (0, 1), "b": (2, 1), "d": (1, 3)}, shared_poison)
    try:
        p = rx.plan(src, dst, backend="direct", options=rx.Options(timeout=20))
        rx.execute(p)
        old = dst
        if rank == 1:
            dst = {n: (shared_poison((32, 64), F32), _lay(1)) for n in dst}
            p.rebind(dst=dst)
        if rank == 2:
            p.transport.device.open = lambda handle: _Refused()  # until the end: the pair leaves the direct path
        kept = {n: t.clone() for n, (t, _) in dst.items()}
        for t, _ in src.values():
            t.mul_(2)
        t0 = time.monotonic()
        try:
            rx.execute(p)
            err = "no error"
        except rx.ReshardError as e:
            err = str(e)
        took = time.monotonic() - t0
        untouched = all(bits_equal(t, kept[n]) for n, (t, _) in dst.items()) and all(
            bits_equal(t, g[n]) for n, (t, _) in old.items())
        p.rebind(collective=True)  # every rank, as the error says
        rx.execute(p)
        landed = all(bits_equal(t, g[n] * 2) for n, (t, _) in dst.items())
        return err, took, untouched, landed, p.transport.direct_peers
    finally:
        release_shared()


def test_one_of_several_senders_that_cannot_map_stops_every_rank_at_once():
    """Rank 2 cannot map rank 1's rebound 'b' while rank 0 maps the new 'a': every rank
    raises at once naming rank 2 and 'b' (rank 0 and rank 3 do not wait for rank 1's
    signals until the direct timeout), nothing lands in rank 1 or leaves it, and a
    collective rebind moves the pair (2, 1) to the other transport and refits."""
    from _dist import close_pool

    try:
        got = run_ranks(4, _one_sender_refuses)
    finally:
        close_pool(4)  # a rank that waited out a direct signal leaves its group unusable
    for rank, (err, took, untouched, landed, direct) in enumerate(got):
        assert "rank 2 cannot map the destination tensors ['b'] that rank 1 rebound" in err, (rank, err)
        assert "plan.rebind(collective=True) on every rank" in err, (rank, err)
        assert took < 5, (rank, took, err)
        assert untouched and landed, (rank, got[rank])
        assert direct == [r for r in range(4) if r != rank and {r, rank} != {1, 2}], (rank, direct)


def _fake_verified(rank, world, case, groups=None):
    """Every execute verified (read passes as the direct writes land) and followed by rx.verify."""
    from test_verify import verified

    return verified(rank, world, _fake_refit, case, None, 1, -1, -1, (), groups)


@pytest.mark.parametrize("case,world", [("two", 2), ("casts", 2), ("meshes", 4)])
def test_verified_direct_refits(case, world):
    for rank, (direct, _, _, _) in enumerate(run_ranks(world, _fake_verified, case)):
        assert direct == [r for r in range(world) if r != rank], (rank, direct)


def _verify_on_one_rank(rank, world):
    from _direct_fake import release_shared

    try:
        p, _, out, g = _fake_pair_plan(rank, 9)
        try:
            rx.execute(p, verify=rank == 0)
            error = "no error"
        except rx.ReshardError as e:
            error = str(e)
        untouched = bool(out.isnan().all())  # still the poison: no write, same-rank or direct, ran
        rx.execute(p, verify=True)
        return error, untouched, bits_equal(out, _DL.local_part(g, rank)), p.transport.direct_peers
    finally:
        release_shared()


def test_verify_on_one_rank_of_a_direct_pair_raises_on_both_before_the_writes():
    """The direct writes land before any check could run: the headers must agree on verify."""
    for rank, (error, untouched, ok, peers) in enumerate(run_ranks(2, _verify_on_one_rank)):
        assert "passed different verify= to rx.execute: False on ranks [1], True on ranks [0]" in error, (rank, error)
        assert untouched and ok and peers == [1 - rank], (rank, untouched, ok, peers)


def _groups_differ(rank, world):
    from _direct_fake import release_shared

    try:
        p = _fake_pair_plan(rank, 8, options=rx.Options(tuning=rx.Tuning(direct_verify_groups=3 if rank else 8)))[0]
        return f"planned, direct peers {p.transport.direct_peers}"
    except rx.ReshardError as e:
        return str(e)
    finally:
        release_shared()


def test_ranks_that_cut_landing_groups_differently_raise_at_plan_time():
    """A receiver that digests group k before its sender wrote it would report a refit that
    landed as corrupt: the group count is agreed when the plan binds."""
    for err in run_ranks(2, _groups_differ):
        assert "direct_verify_groups must be the same on every rank; the ranks have [8, 3]" in err, err


@pytest.mark.parametrize("groups", [1, 5, 255])
def test_verified_direct_refits_with_other_landing_groups(groups):
    for rank, (direct, _, _, _) in enumerate(run_ranks(4, _fake_verified, "pp_experts", groups)):
        assert direct == [r for r in range(4) if r != rank], (rank, direct)


def _corrupt_landed(rank, world):
    """Rank 1 flips one bit of what rank 0 wrote into it, after the writes landed and before
    the verify pass: execute(verify=True) must name the tensor on both ranks; a clean
    verified execute passes first."""
    import _direct_fake
    from _direct_fake import release_shared

    try:
        p, _, out, g = _fake_pair_plan(rank, 5)
        rx.execute(p, verify=True, version=1)
        got = [bits_equal(out, _DL.local_part(g, rank)), p.version]
        wait_landed = _direct_fake._Exec.wait_landed

        def flip(self, stream, k):
            wait_landed(self, stream, k)
            if rank == 1 and k == 0:  # one op per pair here: landing group 0
                out.view(torch.int32)[7, 3] ^= 1  # rank 1 holds rows 0-31: one that rank 0 wrote
        _direct_fake._Exec.wait_landed = flip
        try:
            rx.execute(p, verify=True, version=2)
            got.append("no error")
        except rx.ReshardError as e:
            got.append(str(e))
        finally:
            _direct_fake._Exec.wait_landed = wait_landed
        return got + [p.version]
    finally:
        release_shared()


class _CountedPiece(rx.transforms.Piece):
    """A destination piece that counts how often the plan binds it."""

    def __init__(self, out: torch.Tensor):
        super().__init__(tuple(out.shape), out.dtype, out.device)
        self.out, self.binds = out, 0

    def ref(self, whole: bool) -> _C.TensorRef:
        self.binds += 1
        return _C.TensorRef(self.out.data_ptr(), self.out.stride(), code_of(self.out.dtype))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.out,)


def _verify_binds_once(rank, world):
    """A verified direct execute reads its digests through the plan's whole tables: they
    must reuse the refs the plan bound, not bind its pieces again (a staged MXFP8 piece
    rebound under the whole tables dropped its staging while the peer still wrote into it)."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device()
    try:
        g = torch.randn(64, 512, generator=torch.Generator().manual_seed(6))
        piece = _CountedPiece(shared_poison(_DL.local_shape(rank), F32))
        p = rx.plan({"w": (_SL.local_part(g, rank).clone(), _SL)}, {"w": (piece, _DL)}, backend="direct")
        bound = piece.binds
        rx.execute(p, verify=True)
        rx.execute(p, verify=True)
        rx.verify(p)
        return bound, piece.binds, bits_equal(piece.out, _DL.local_part(g, rank)), p.transport.direct_peers
    finally:
        release_shared()


def test_a_verified_direct_execute_does_not_rebind_pieces():
    for rank, (bound, after, ok, peers) in enumerate(run_ranks(2, _verify_binds_once)):
        assert peers == [1 - rank] and ok, (rank, peers, ok)
        assert bound >= 1 and after == bound, (rank, bound, after)


def test_a_direct_write_corrupted_after_landing_fails_verify_on_both_ranks():
    for rank, (ok, v1, err, v2) in enumerate(run_ranks(2, _corrupt_landed)):
        assert ok and v1 == 1, (rank, ok, v1)
        assert "'w'[0:32, 0:256] from rank 0 to rank 1" in err, (rank, err)
        assert v2 is None, (rank, v2)


# --- GPUs -------------------------------------------------------------------------------

def _pairs_of(plan) -> tuple:
    t = plan.transport
    return (t.direct_peers, t.nccl_peers, t.staging_bytes, plan.num_ops)


def _all_direct(world: int, case: str, max_batch_bytes) -> None:
    """The refit matrix, every pair direct: no staging, nothing over NCCL."""
    for rank, (direct, nccl, staging, _) in enumerate(
            run_ranks(world, run_case, case, "cuda", max_batch_bytes, "direct", None, _pairs_of, backend="nccl")):
        assert direct == [r for r in range(world) if r != rank] and nccl == [] and staging == 0, (rank, direct, nccl)


@needs2
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
@pytest.mark.parametrize("max_batch_bytes", [None, 4096])
def test_matrix_2gpu(case, max_batch_bytes):
    _all_direct(2, case, max_batch_bytes)


@needs2
@pytest.mark.parametrize("engine_bytes", [0, 1])
@pytest.mark.parametrize("case", ["two", "tp", "casts"])
def test_engines_and_kernel_2gpu(case, engine_bytes):
    """Every eligible box on the copy engines (1), or none (0: the kernel stores into the peer)."""
    run_ranks(2, run_case, case, "cuda", None, "direct", rx.Options(tuning=rx.Tuning(direct_engine_bytes=engine_bytes)),
              backend="nccl")


# (peer engine threshold, same-rank engine threshold, batched calls, same-rank kernel grid cap, engine streams)
PATHS = {
    "kernel_only": (0, 0, True, 0, 1),
    "engines_batched": (1, 1, True, 0, 1),
    "engines_per_copy": (1, 1, False, 0, 1),
    "engines_3_streams": (1, 1, True, 0, 3),
    "mixed_capped": (4096, 4096, True, 2, 2),
}


def _paths_gpu(rank, world, path, optout=-1):
    engine, local, batch, blocks, streams = PATHS[path]
    options = rx.Options(relay=False, tuning=rx.Tuning(
        direct_engine_bytes=engine, direct_local_engine_bytes=local, direct_engine_batch=batch,
        direct_local_blocks=blocks, direct_engine_streams=streams))
    if rank == optout:
        options = options.replace(direct_ipc=False)
    got = run_case(rank, world, "many_boxes", "cuda", None, "direct", options, _paths_of)
    return got, _engine_mode(rank, world, options)


def _engine_mode(rank, world, options):
    """engine_mode of a small plan of whole tensors from rank 0 to the others."""
    sl = Layout((4, 256), F32, Mesh([0]), [Replicate()])
    dl = Layout((4, 256), F32, Mesh(list(range(world))), [Replicate()])
    src = {f"w{i}": (torch.randn(4, 256, device="cuda"), sl) for i in range(3)} if rank == 0 else {}
    dst = {f"w{i}": (torch.zeros(4, 256, device="cuda"), dl) for i in range(3)}
    p = rx.plan(src, dst, backend="direct", options=options)
    rx.execute(p)
    torch.cuda.synchronize()
    ex = p.transport.exec
    return ex.engine_mode if rank == 0 and ex is not None else ""


@needs2
@pytest.mark.parametrize("path", sorted(PATHS))
def test_small_boxes_and_batched_engines_2gpu(path):
    """Hundreds of tiny boxes in the kernel, batched (or per-copy) copy-engine runs and
    pitched copies, same-rank copies on a copy engine or a capped kernel: bit for bit."""
    _paths_check(2, path)


@needs4
@pytest.mark.parametrize("path", sorted(PATHS))
def test_small_boxes_and_batched_engines_4gpu(path):
    _paths_check(4, path)


def _paths_check(world, path):
    engine, local, batch, _, _ = PATHS[path]
    for rank, ((own, n_engine, n_kernel, n_local_engine, n_local_kernel, nccl), mode) in enumerate(
            run_ranks(world, _paths_gpu, path, backend="nccl")):
        assert own and nccl == [] and n_kernel > 0 and n_local_kernel > 0, (rank, path)
        assert (n_engine > 0) == (engine > 0) and (n_local_engine > 0) == (local > 0), (rank, path)
        if rank == 0 and engine:
            assert mode == ("batched" if batch else "per copy"), mode


@needs4
def test_small_boxes_beside_nccl_pairs_4gpu():
    """Rank 3 opts out: the others' direct writes (batched engines, tiny boxes in the
    kernel) run beside NCCL pairs, which keep the same-rank copies; bit for bit."""
    own_gpus()
    for rank, (got, _) in enumerate(run_ranks(4, _paths_gpu, "engines_batched", 3, backend="nccl")):
        if rank == 3:
            assert got is None, got
        else:
            own, n_engine, n_kernel, n_local_engine, _, nccl = got
            assert not own and nccl == [3] and n_engine > 0 and n_kernel > 0 and n_local_engine == 0, (rank, got)


@needs4
@pytest.mark.parametrize("case", ["tp", "uneven_blocks", "meshes", "pp_experts", "placement", "casts"])
@pytest.mark.parametrize("max_batch_bytes", [None, 4096])
def test_matrix_4gpu(case, max_batch_bytes):
    _all_direct(4, case, max_batch_bytes)


def _opted_out(rank, world, out, case, backend):
    options = rx.Options(direct_ipc=False, auto_direct=True) if rank == out else rx.Options(auto_direct=True)
    return run_case(rank, world, case, "cuda", 4096, backend, options, _pairs_of)


@needs2
@pytest.mark.parametrize("backend", ["direct", "auto"])
def test_pair_falls_back_to_nccl_2gpu(backend):
    """A rank that maps nothing: its pairs move over NCCL, on both ends, bit for bit."""
    own_gpus()
    for direct, nccl, staging, _ in run_ranks(2, _opted_out, 1, "tp", backend, backend="nccl"):
        assert direct == [] and nccl and staging > 0


@needs4
@pytest.mark.parametrize("case", ["tp", "meshes", "pp_experts"])
def test_mixed_direct_and_nccl_4gpu(case):
    """Rank 3 opts out: pairs with it use NCCL, the others stay direct, in one plan."""
    own_gpus()
    for rank, (direct, nccl, _, _) in enumerate(run_ranks(4, _opted_out, 3, case, "direct", backend="nccl")):
        assert 3 not in direct and (rank == 3 or set(nccl) <= {3}) and (rank != 3 or direct == []), (rank, direct, nccl)


def _expandable_dst(rank, world):
    """Rank 1's destination comes from torch's expandable segments (cuMem): CUDA IPC cannot
    share it, so the pair falls back to NCCL instead of failing."""
    set_alloc = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if set_alloc is None:
        return None
    sl = Layout((64, 512), F32, Mesh([0, 1]), [Shard(1)])
    dl = Layout((64, 512), F32, Mesh([0, 1]), [Replicate()])
    g = torch.randn(64, 512, generator=torch.Generator().manual_seed(5))
    src = {"w": (sl.local_part(g, rank).cuda(), sl)}
    if rank == 1:
        set_alloc("expandable_segments:True")
    try:
        out = torch.full(dl.local_shape(rank), float("nan"), device="cuda")
    finally:
        if rank == 1:
            set_alloc("expandable_segments:False")
    p = rx.plan(src, {"w": (out, dl)}, backend="direct")
    rx.execute(p)
    torch.cuda.synchronize()
    return bits_equal(out.cpu(), g), p.transport.direct_peers


@needs2
def test_unmappable_memory_falls_back_2gpu():
    own_gpus()
    got = run_ranks(2, _expandable_dst, backend="nccl")
    if got[0] is None:
        pytest.skip("this torch cannot switch to expandable segments at run time")
    assert all(ok for ok, _ in got), got
    if any(direct for _, direct in got):
        pytest.skip("this allocator's expandable segments were mappable here (the pair went direct, correctly)")


def _skips_execute(rank, world, sender, receiver):
    """`receiver` never calls execute (or, when it is the one that skips, `sender` does not)."""
    import time

    sl = Layout((256, 256), F32, Mesh([sender]), [Replicate()])
    dl = Layout((256, 256), F32, Mesh([receiver]), [Replicate()])
    src = {"w": (torch.randn(256, 256, device="cuda"), sl)} if rank == sender else {}
    dst = {"w": (torch.zeros(256, 256, device="cuda"), dl)} if rank == receiver else {}
    p = rx.plan(src, dst, backend="direct", options=rx.Options(timeout=2.0))
    assert p.transport.direct_peers == [1 - rank]
    if rank == 1:
        return "skipped"
    t0 = time.monotonic()
    try:
        rx.execute(p)
        torch.cuda.synchronize()
    except rx.ReshardError as e:
        return f"{time.monotonic() - t0:.1f}s: {e}"
    return "no error"


@needs2
@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_peer_that_never_executes_raises_2gpu(role):
    """Rank 1 never executes: rank 0 raises ReshardError naming it within the timeout, as a
    sender or as a receiver, instead of hanging: the execute headers that every pair
    exchanges before any direct write find it missing."""
    sender, receiver = (0, 1) if role == "sender" else (1, 0)
    msg = run_ranks(2, _skips_execute, sender, receiver, backend="nccl", timeout=120)[0]
    assert "rank 1 sent no execute header within" in msg and "did not call rx.execute" in msg, msg


def _late_sender(rank, world):
    """Rank 0's stream is busy for 6 s when a verified execute queues its writes to rank 1
    (the same bytes as the first execute's)."""
    import time

    sl = Layout((256, 256), F32, Mesh([0]), [Replicate()])
    dl = Layout((256, 256), F32, Mesh([1]), [Replicate()])
    src = {"w": (torch.randn(256, 256, device="cuda"), sl)} if rank == 0 else {}
    dst = {"w": (torch.zeros(256, 256, device="cuda"), dl)} if rank == 1 else {}
    p = rx.plan(src, dst, backend="direct", options=rx.Options(timeout=2.0))
    assert p.transport.direct_peers == [1 - rank]
    rx.execute(p, verify=True)  # a warm one first
    torch.cuda.synchronize()
    if rank == 0:
        torch.cuda._sleep(12_000_000_000)  # ~6 s at 2 GHz
    t0 = time.monotonic()
    try:
        rx.execute(p, verify=True)
        torch.cuda.synchronize()
    except rx.ReshardError as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, "no error"


@needs2
def test_a_late_sender_fails_the_receivers_verified_execute_within_the_timeout_2gpu():
    """The receiver's wait for a sender that does not signal its writes in time ends with the
    direct timeout, also where a verified execute queued its check behind that wait (the host
    waits after): ReshardError naming the sender. The execute failed, so the sender raises
    too, when its part ends, with the receiver's cause."""
    (t_send, sent), (t_recv, got) = run_ranks(2, _late_sender, backend="nccl", timeout=120)
    assert "rank 0 did not signal within 2 s" in got and t_recv < 5, (t_recv, got)
    assert "rank 1: rank 0 did not signal within 2 s" in sent and "rank 1: rank 1" not in sent, sent
    assert t_send > 5, (t_send, sent)


@needs2
def test_rebind_remaps_2gpu():
    """Rebinding the destinations: the sender maps the new tensors; the old memory, reused
    by another tensor, stays untouched."""
    from test_refit_gpu import _rebind_registered

    for ok in run_ranks(2, _rebind_registered, None, "direct", backend="nccl"):
        assert ok[:3] == [True, True, True] and tuple(ok[3][:2]) == (1, 1), ok


@needs2
@pytest.mark.parametrize("side", ["dst", "src"])
def test_a_rank_rebinds_alone_2gpu(side):
    """plan.rebind is local with direct pairs (real CUDA IPC): rank 1 alone rebinds its
    destinations or sources; rank 0 maps the new destinations in the next execute only."""
    _check_rebind_one(run_ranks(2, _rebind_one, 1, side, True, backend="nccl"), 1, side)


@needs2
@pytest.mark.parametrize("refuse", ["open", "executor"])
def test_a_sender_that_cannot_map_rebound_destinations_raises_2gpu(refuse):
    own_gpus()
    _check_refused(run_ranks(2, _rebind_one, 1, "dst", True, refuse, backend="nccl"), refuse)


def _repeat(rank, world, n):
    """Many executes in a row (the sequence numbers of the signals advance each time)."""
    sl = Layout((1024, 1024), BF16, Mesh([0, 1]), [Shard(1)])
    dl = Layout((1024, 1024), BF16, Mesh([1, 0]), [Shard(0)])
    g = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3)).to(BF16)
    src = {"w": (sl.local_part(g, rank).cuda(), sl)}
    out = torch.empty(dl.local_shape(rank), dtype=BF16, device="cuda")
    p = rx.plan(src, {"w": (out, dl)}, backend="direct")
    for i in range(n):
        src["w"][0].copy_(sl.local_part(g + i, rank))
        rx.execute(p)
    torch.cuda.synchronize()
    return bits_equal(out.cpu(), dl.local_part((g + (n - 1)).to(BF16), rank))


@needs2
def test_many_executes_2gpu():
    assert all(run_ranks(2, _repeat, 50, backend="nccl"))


def _fake_headers(rank, world):
    """The direct backend carries the execute headers too: versions agree or both ranks
    raise before any direct write, and a replaced tensor on one rank raises on both."""
    from _direct_fake import release_shared, shared_poison, use_fake_device

    use_fake_device()
    try:
        sl = Layout((64, 512), F32, Mesh([0, 1]), [Shard(1)])
        dl = Layout((64, 512), F32, Mesh([1, 0]), [Shard(0)])
        g = torch.randn(64, 512, generator=torch.Generator().manual_seed(4))
        src = {"w": (sl.local_part(g, rank).clone(), sl)}
        out = shared_poison(dl.local_shape(rank), F32)
        p = rx.plan(src, {"w": (out, dl)}, backend="direct")
        rx.execute(p, version=1)
        got = [p.version, p.transport.direct_peers]
        for version in ([2, 3][rank], None):
            try:
                if version is None:  # a replaced source on rank 0 only
                    if rank == 0:
                        src["w"][0].data = src["w"][0].clone()
                    rx.execute(p, version=9)
                else:
                    rx.execute(p, version=version)
                got.append("no error")
            except rx.ReshardError as e:
                got.append(str(e))
            got.append(p.version)
        return got + [bits_equal(out, dl.local_part(g, rank))]
    finally:
        release_shared()


def test_transport_direct_pairs_exchange_headers():
    for rank, got in enumerate(run_ranks(2, _fake_headers)):
        assert got[:2] == [1, [1 - rank]], got
        assert "version" in got[2] and got[3] is None, got
        assert "replaced or resized" in got[4] or "failed a check of its own" in got[4], got[4]
        assert got[5] is None and got[6], got


def test_fold_into_adds_pieces_lane_by_lane():
    """A verified execute's staged pieces fold into their ops' digests as digest::add adds:
    two 32-bit lanes, no carry between them; a piece of row len(ops) is dropped."""
    from reshard_ext.transports.digests import fold_into

    rng = np.random.default_rng(0)
    per = rng.integers(0, 2**64, size=50, dtype=np.uint64, endpoint=False)
    rows = rng.integers(0, 5, size=50)
    ops = np.array([3, 0, 7, 5])
    into = rng.integers(0, 2**64, size=9, dtype=np.uint64, endpoint=False)
    m = 0xFFFFFFFF
    want = [int(x) for x in into]
    for d, r in zip(per, rows):
        if r < len(ops):
            a, b = want[ops[r]], int(d)
            want[ops[r]] = ((a + b) & m) | ((((a >> 32) + (b >> 32)) & m) << 32)
    fold_into(torch.from_numpy(into.view(np.int64)), torch.from_numpy(per.view(np.int64)), torch.from_numpy(rows),
              torch.from_numpy(ops))
    assert [int(x) for x in into] == want


def test_staged_send_rows_digest_only_wholly_staged_ops():
    """An op whose every box is staged takes its digest from the ring (folded by send index);
    an op with a box left to the kernel is read from its source whole: its staged pieces drop."""
    from reshard_ext.transports.direct import staged_send_rows

    box_ops = [0, 1, 1, 2, 2, 2, 3]  # direct send op of each direct box; box 5 (op 2) is not staged
    staged = [1, 2, 3, 4, 6]
    rows, ops = staged_send_rows([box_ops[b] for b in staged], box_ops, [10, 11, 12, 13])
    assert ops == [11, 13] and rows == [0, 0, 2, 2, 1], (rows, ops)


def test_direct_timeline_sums_what_the_link_waited_for():
    """The staged path's timeline summary: writes' busy and idle time, the copy streams' waits
    for packs (a stream free before its next chunk was packed) and the pack stream's for slots."""
    from reshard_ext.transports.direct import direct_timeline_text

    rows = [("start", 0, 0.0, 0.0), ("engine", 0, 0.0, 1.0)]
    for c in range(4):  # packs of 1 ms back to back; copies of 1 ms, stream c % 2
        rows.append(("pack", c, float(c), c + 1.0))
    rows += [("copy", 0, 1.0, 2.0), ("copy", 1, 2.0, 3.0), ("copy", 2, 3.0, 4.0), ("copy", 3, 4.0, 5.0),
             ("signal", 0, 5.0, 5.1), ("end", 0, 5.2, 5.2)]
    text = direct_timeline_text(rows, streams=2)
    assert "span 5.200 ms" in text and "busy 5.000 ms, idle between 0.000 ms" in text, text
    # chunk 2's stream was free at 2.0 and its pack ended at 3.0; chunk 3's: free at 3.0, packed at 4.0
    assert "copy streams waited 2.000 ms for packs" in text and "waited 0.000 ms for free slots" in text, text
    assert "chunk 3" in text and "copy (stream 1)" in text, text


def test_mxfp8_sender_staged_digests_with_other_ring_shapes(monkeypatch):
    """A verified execute's staged send digests equal the sources' with 2 and 6 slots and 1 and
    3 copy streams (RESHARD_EXT_DIRECT_STAGING_SLOTS / _STREAMS), bytes alike."""
    from reshard_ext import options

    for slots, streams in ((2, 1), (6, 3)):
        monkeypatch.setenv("RESHARD_EXT_DIRECT_STAGING_SLOTS", str(slots))
        monkeypatch.setenv("RESHARD_EXT_DIRECT_STAGING_STREAMS", str(streams))
        options._CACHE.clear()
        stats = _mxfp8_direct("all", "sender", "2d", 2, wide=True, stage_bytes=256, landing=True, policy=3)
        assert stats["staged"] > 0 and stats["digested_ops"] > 0, stats
    options._CACHE.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not gpus_for(1) or not CUDA_BUILT, reason="needs a GPU and reshard_ext built with CUDA")
def test_signal_words_zeroed_beside_a_busy_stream():
    """A plan's signal words are zeroed on a stream of their own: making them does not wait for
    work already queued on the device (a stream blocked for good by an earlier plan would make
    a device-wide synchronize wait forever; here a kernel that spins for a while stands in)."""
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(4_000_000_000)  # about 2 s of spinning at H100/H200 clocks
    signals = _C.DirectSignals(0, 1, torch.cuda.current_device(), 30.0)
    still_busy = not busy.query()
    busy.synchronize()
    assert signals.seq == 0
    assert still_busy, "making the signal words waited for another stream's work"
