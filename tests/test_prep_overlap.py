"""Deferred pre-pass work on the direct path (rx.Tuning.direct_prep_overlap): a sender-side
codec's amax pre-pass and scales run per tensor on a prep stream while the staged chunks of
the tensors before it move, each chunk's pack gated on its own tensors' work
(csrc/core/direct.h, prep_schedule). Checked here on the CPU: the C++ chunk -> gate mapping,
sender-side FP8Block and NVFP4 refits through the staging script's emulation
(tests/_direct_sim.py) byte-identical to the references in every stream order the script
allows, executes after the sources change, a gate removed or one chunk early caught, and the
transport's plumbing over real process groups on the CPU stand-in of the device."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from _boxes import BOX
from _direct_sim import all_pairs, prep_event, simulate
from _dist import gpu_of, gpus_for, run_ranks

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate, Shard
from reshard_ext.codecs import fp8block as fcodec
from reshard_ext.fp8block import FP8Block
from reshard_ext.layout import code_of
from reshard_ext.nvfp4 import NVFP4
from reshard_ext.transforms import Piece

BF16, F32 = torch.bfloat16, torch.float32


# --- the C++ chunk -> gate mapping ------------------------------------------------------------

def _box(src: int, shape: tuple[int, ...], src_stride: tuple[int, ...], dtype: torch.dtype = BF16) -> np.ndarray:
    """A staged-looking box (codec boxes are what gets staged; the mapping reads src spans only)."""
    b = np.zeros(1, dtype=BOX)
    b["src"], b["dst"], b["ndim"] = src, 1 << 40, len(shape)
    b["shape"][0, :len(shape)] = shape
    b["src_stride"][0, :len(shape)] = src_stride
    stride = 1
    for d in reversed(range(len(shape))):
        b["dst_stride"][0, d] = stride
        stride *= shape[d]
    b["src_dtype"] = b["dst_dtype"] = code_of(dtype)
    return b


def _schedule(boxes: list[np.ndarray], slot: int, regions: list[tuple[int, int]]) -> tuple[list, list, list]:
    """(order, gates, chunk of each box) of boxes staged in slots of `slot` bytes."""
    table = np.concatenate(boxes).tobytes()
    plan, rest = _C.plan_staging(table, [], [1] * len(boxes), slot)
    assert rest == []
    chunk_of = {b: c for c in range(plan.num_chunks) for b in plan.chunk(c)[5]}
    order, gates = plan.prep_schedule(regions)
    return order, gates, [chunk_of[i] for i in range(len(boxes))]


def test_src_spans_reach_a_codec_coordinate_whole():
    """A box reads its elements' span; a coordinate stepping over a block (NVFP4 scales: 8
    words each) reads up to the next one."""
    plain = _box(1000, (4, 8), (100, 1))
    blocks = _box(1000, (4, 2), (16, 8), torch.int32)
    assert _C.src_spans(np.concatenate([plain, blocks]).tobytes()) == [(1000, 1000 + 2 * (3 * 100 + 8)),
                                                                       (1000, 1000 + 4 * (3 * 16 + 8 + 8))]


def test_prep_gates_follow_the_regions_each_chunk_reads():
    """Regions A, B, C of three tensors, D never read by a staged box, E an alias of B (the same
    memory under two names), F overlapping C's second half. Chunks (one 512 B slot each): c0
    reads A; c1 reads A's tail and B (a chunk reading two tensors: it waits for the later); c2
    reads no region; c3 reads C. The order is first-read, each gate the position of the latest
    region a chunk's boxes overlap (an alias or an overlapping region gates alike)."""
    a, b, c = 0x10000, 0x20000, 0x30000
    boxes = [
        _box(a, (2, 128), (128, 1)),        # c0: A [0, 512)
        _box(a + 512, (1, 64), (64, 1)),    # c1: A's tail ...
        _box(b, (1, 64), (64, 1)),          # ... and B, one chunk of 2 x 128 B (each aligned to 256)
        _box(0x90000, (2, 128), (128, 1)),  # c2: no region
        _box(c, (2, 128), (128, 1)),        # c3: C (and F)
    ]
    regions = [(a, 640), (b, 128), (c, 512), (0x50000, 64), (b, 128), (c + 256, 256)]  # A B C D E F
    order, gates, chunk = _schedule(boxes, 512, regions)
    assert chunk == [0, 1, 1, 2, 3]
    assert order[0] == 0 and sorted(order[1:3]) == [1, 4] and sorted(order[3:]) == [2, 5], order
    assert gates == [0, 2, -1, 4], gates


def test_prep_gates_interleaved_views_wait_for_the_latest():
    """Column halves of one [4, 256] BF16 matrix as two tensors: their spans interleave, so a
    box of either reads inside both spans and waits for both tensors' work (conservative, never
    early); a region of 0 bytes is read by nothing."""
    base = 0x40000
    left = _box(base, (4, 128), (256, 1))          # tensor L: columns [0, 128)
    right = _box(base + 256, (4, 128), (256, 1))   # tensor R: columns [128, 256)
    span = 2 * (3 * 256 + 128)
    regions = [(base + 256, span), (base, span), (base, 0)]  # R, L (each's span), an empty one
    order, gates, chunk = _schedule([left, right], 1024, regions)
    assert chunk == [0, 1] and sorted(order) == [0, 1] and gates == [1, 1], (order, gates)


def test_prep_script_waits_before_each_pack_for_its_gate():
    """The script: the prefill starts at STAGE_SOURCES (not STAGE_START), a pack waits for its
    gate's prep event only when it is later than the pack stream already waited for."""
    boxes = [_box(0x1000 * (i + 1), (1, 128), (128, 1)) for i in range(6)]
    plan, _ = _C.plan_staging(np.concatenate(boxes).tobytes(), [], [1] * 6, 256, [], 2)
    assert plan.num_chunks == 6
    gates = [0, -1, 2, 2, 1, 4]
    streams, events, prefill, parts = plan.script(0, 2, False, gates)
    acts = prefill + [a for p in parts for a in p]
    pack_stream = [(op, arg) for op, s, arg in acts if s == 0]
    assert pack_stream[0] == (2, _C.STAGE_SOURCES)  # op 2: a wait
    waits_before = {}
    last = None
    for op, arg in pack_stream:
        if op == 2 and arg <= _C.STAGE_PREP0:
            last = arg
        if op == 0:
            waits_before[arg] = last
            last = None
    assert waits_before == {0: prep_event(0), 1: None, 2: prep_event(2), 3: None, 4: None, 5: prep_event(4)}
    assert plan.script(0, 2, False)[2][0] == (2, 0, _C.STAGE_START)  # no gates: as before


# --- refits through the emulated direct path ---------------------------------------------------

def _L(shape, mesh, placements, dtype=BF16) -> Layout:
    return Layout(shape, dtype, Mesh(mesh), placements)


def _at(transform, rank: int):
    """`transform` as rank `rank` sees it (the emulation has no process group)."""
    transform._rank = lambda: rank  # noqa: SLF001 - the transforms ask for their rank; one process plays them all
    return transform


def cases(kind: str, tp1: tuple[int, int], tp2: list[int], dst: int) -> dict[str, tuple[Layout, Layout]]:
    """name -> (src layout, dst layout): TP1 -> TP1 from ranks tp1 (blocks whole: deferred),
    TP2 -> TP1 from ranks tp2 (whole blocks, and cut ones whose amaxes travel: the pre-pass),
    and a tensor quantized before the boxes (not fused: the pre-pass), all into rank dst."""
    if kind == "fp8":
        return {
            "tp1.a": (_L((256, 384), [tp1[0]], [Replicate()]), _L((256, 384), [dst], [Replicate()])),
            "tp1.b": (_L((128, 256), [tp1[1]], [Replicate()]), _L((128, 256), [dst], [Replicate()])),
            "tp1.experts": (_L((3, 136, 256), [tp1[0]], [Replicate()]), _L((3, 136, 256), [dst], [Replicate()])),
            "tp2.whole": (_L((256, 256), tp2, [Shard(0)]), _L((256, 256), [dst], [Replicate()])),  # 128-row shards
            "tp2.cut": (_L((128, 256), tp2, [Shard(0)]), _L((128, 256), [dst], [Replicate()])),    # 64 rows each
            "tp1.k300": (_L((130, 300), [tp1[0]], [Replicate()]), _L((130, 300), [dst], [Replicate()])),
        }
    return {
        "tp1.a": (_L((64, 256), [tp1[0]], [Replicate()]), _L((64, 256), [dst], [Replicate()])),
        "tp1.b": (_L((40, 128), [tp1[1]], [Replicate()]), _L((40, 128), [dst], [Replicate()])),
        "tp1.experts": (_L((4, 32, 128), [tp1[0]], [Replicate()]), _L((4, 32, 128), [dst], [Replicate()])),
        "tp2.rows": (_L((130, 256), tp2, [Shard(0)]), _L((130, 256), [dst], [Replicate()])),  # the amax travels
        "tp1.fp32": (_L((64, 128), [tp1[0]], [Replicate()], F32), _L((64, 128), [dst], [Replicate()])),
    }


def _sources(specs: dict, step: int, kind: str) -> dict:
    if kind == "fp8":
        from test_fp8block_kernels import special_case

        return {n: special_case(sl.shape, sl.dtype, seed=(zlib.crc32(n.encode()) + 31 * step) % 100003)
                for n, (sl, _) in specs.items()}
    from _nvfp4_ref import make_case

    kinds = ("normal", "wide", "bits", "tiny")
    return {n: make_case(kinds[(len(n) + step) % len(kinds)], tuple(sl.shape), f"{n}{step}").to(sl.dtype)
            for n, (sl, _) in specs.items()}


def _poison(n: int, seed: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return torch.randint(1, 255, (n,), dtype=torch.uint8, generator=g)


def destinations(kind: str, specs: dict, rank: int, dev: str = "cpu") -> dict:
    """Poisoned destination buffers of this rank's pieces."""
    out = {}
    for n, (_, dl) in sorted(specs.items()):
        if rank not in dl.mesh:
            continue
        local = dl.local_shape(rank)
        if kind == "fp8":
            slocal = fcodec.scale_layout(n, dl, "convert").local_shape(rank)
            bufs: tuple = (_poison(math.prod(local), n).view(torch.float8_e4m3fn).view(local),
                           _poison(4 * math.prod(slocal), n + "s").view(F32).view(slocal))
        else:
            bufs = (_poison(math.prod(local) // 2, n).view(local[:-1] + (local[-1] // 2,)),
                    _poison(math.prod(local) // 16, n + "s").view(local[:-1] + (local[-1] // 16,)),
                    torch.tensor(float("nan")))
        out[n] = (tuple(t.to(dev) for t in bufs), dl)
    return out


def check(kind: str, specs: dict, dst: dict, logical: dict, rank: int, what: str) -> None:
    """This rank's destinations hold the references' bytes of the logical tensors."""
    for n, (bufs, dl) in dst.items():
        if kind == "fp8":
            from test_fp8block_kernels import assert_bytes, ref_fp8block

            want_d, want_s = ref_fp8block(logical[n], "fp32")
            assert_bytes(bufs[0].cpu(), dl.with_dtype(torch.uint8).local_part(want_d, rank), f"{n} data, {what}")
            assert_bytes(bufs[1].cpu(), fcodec.scale_layout(n, dl, "convert").local_part(want_s, rank),
                         f"{n} scale_inv, {what}")
        else:
            from _nvfp4_ref import ref_nvfp4
            from test_nvfp4_refit import check as nv_check

            nv_check(n, dl, rank, bufs, ref_nvfp4(logical[n].to(BF16)), "2d", what)


def _refit(kind: str, policy, landing: bool, prep: bool, gates=None, stage_bytes: int = 4096) -> dict:
    """Two sender-side refits (the sources change between them) through simulate with the
    direct pairs staged; the destinations checked against the references after each; between
    executes every factor, scale and amax cell the boxes read is poisoned, so a pack that runs
    before its tensor's deferred work writes wrong bytes."""
    world = 3
    specs = cases(kind, (0, 1), [0, 1], 2)
    names = sorted(specs)
    logical = _sources(specs, 0, kind)
    src: list[dict] = [{} for _ in range(world)]
    for r in range(world):
        for n in names:
            sl, _ = specs[n]
            if r in sl.mesh:
                src[r][n] = (sl.local_part(logical[n], r).clone(), sl)
    dst = [destinations(kind, specs, r) for r in range(world)]
    pieces: list[Piece] = []

    def transform(r: int):
        t = _at(FP8Block(names, where="sender") if kind == "fp8" else NVFP4(names, where="sender"), r)
        rewrite = t.rewrite_src

        def capture(name, tensor, layout):
            rw = rewrite(name, tensor, layout)
            pieces.extend(e for e, _ in (rw.entries.values() if rw else ()) if isinstance(e, Piece))
            return rw

        t.rewrite_src = capture
        return t

    def each(step: int) -> None:
        nonlocal logical
        for r in range(world):
            check(kind, specs, dst[r], logical, r, f"execute {step}")
        logical = _sources(specs, step + 1, kind)  # the next execute's sources, changed in place
        for r in range(world):
            for n, (t, sl) in src[r].items():
                t.copy_(sl.local_part(logical[n], r))
        for p in pieces:  # every value a box reads besides the source: stale and wrong from here on
            if kind == "fp8":
                p.scales.mult.fill_(0x11111111)
                p.scales.amax.grid.fill_(0x7F000000)
            else:
                p.cell.fill_(0x3F800000)

    stats: dict = {}
    simulate(src, dst, all_pairs(world), engine_bytes=1, transform=transform, stats=stats, landing=landing,
             stage_bytes=stage_bytes, policy=policy, prep=prep, executes=2, each=each, gates=gates)
    return stats


POLICIES = ["pack", "copy", 0, 1, 2]


@pytest.mark.parametrize("landing", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_sender_refit_with_deferred_prep_is_exact(kind, policy, landing):
    """FP8Block / NVFP4 sender side, TP1 -> TP1 and TP2 -> TP1 (whole and cut blocks), staged in
    many chunks: with the pre-pass deferred per tensor, byte for byte as the references in any
    order the script allows, execute after execute; tensors whose pieces cut blocks (their
    amaxes travel) and those quantized before the boxes keep the pre-pass."""
    stats = _refit(kind, policy, landing, prep=True)
    # the fused tensors whose blocks are whole on their rank: tp1.a, tp1.experts on rank 0, tp1.b on rank 1, and
    # FP8's tp2.whole on both
    assert stats["deferred"] == ([3, 2, 0] if kind == "fp8" else [2, 1, 0]), stats
    assert stats["chunks"] > 2 * _C.STAGE_SLOTS, stats


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_sender_refit_without_deferral_is_exact(kind):
    """The same refits with the knob off: everything in the pre-pass, as before."""
    stats = _refit(kind, "pack", False, prep=False)
    assert stats["deferred"] == [0, 0, 0], stats


@pytest.mark.parametrize("broken", ["removed", "one chunk early"])
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_a_missing_or_early_gate_is_caught(kind, broken):
    """The emulation is no rubber stamp: the packs run as soon as the script lets them
    ("pack"), so a chunk whose gate is gone, or is the previous chunk's, quantizes its tensor
    with the poisoned factors of the execute before: wrong bytes."""
    edit = (lambda g: [-1] * len(g)) if broken == "removed" else (lambda g: [-1] + g[:-1])
    with pytest.raises(AssertionError, match="differ|data|scale"):
        _refit(kind, "pack", False, prep=True, gates=edit)


# --- the transport over real process groups, on the CPU stand-in of the device ----------------

def _fake_worker(rank: int, world: int, kind: str, overlap: bool, verify: bool, rebuilt: bool = False) -> list:
    from _direct_fake import release_shared, use_fake_device

    use_fake_device()
    if rebuilt:
        _rebuild_after_headers()
    try:
        if kind == "fp8":
            from test_fp8block_refit import refit_worker

            return _with_options(refit_worker, overlap, rank, world, "sender", "fp32", verify=verify,
                                 backend="direct", shared=True)
        from test_nvfp4_refit import refit_worker as nv_worker

        return _with_options(nv_worker, overlap, rank, world, "sender", "2d", verify, "cpu", "direct", True)
    finally:
        release_shared()


def _rebuild_after_headers() -> None:
    """Every execute of this process's direct transports rebuilds its executor after the
    headers (as a remap onto rebound destinations does), into one that defers nothing: the
    work Plan already skipped for this execute must still run."""
    from reshard_ext.transports.direct import DirectTransport

    real_run, real_remap = DirectTransport.run, DirectTransport._remap

    def remap(self, session, outbox):  # noqa: ANN001, ANN202
        real_remap(self, session, outbox)
        self._prep = []

    def run(self, tables, session, verify=False):  # noqa: ANN001, ANN202
        kept = self._prep
        try:
            return real_run(self, tables, session, verify)
        finally:
            self._prep = kept  # the next execute defers again

    DirectTransport.run, DirectTransport._remap = run, remap  # type: ignore[method-assign]


def _with_options(worker, overlap: bool, *args, **kw):
    """Runs a refit worker with every rx.plan of this process on the direct transport, with
    deferred prep on or off and a small staging ring (many chunks); returns what each plan's
    transport deferred."""
    from reshard_ext import execution

    plan_fn, seen = rx.plan, []

    def plan(*a, **k):
        k["options"] = rx.Options(tuning=rx.Tuning(direct_prep_overlap=overlap, direct_staging_bytes=16 << 10,
                                                   direct_engine_bytes=1))
        k["backend"] = "direct"
        p = plan_fn(*a, **k)
        seen.append(p)
        return p

    rx.plan = execution.plan = plan  # type: ignore[assignment]
    try:
        worker(*args, **kw)
    finally:
        rx.plan = execution.plan = plan_fn  # type: ignore[assignment]
    return [sorted(item.name for item, _ in getattr(p.transport, "deferred", ())) for p in seen]


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_refit_over_the_direct_transport_defers_and_stays_exact(kind, verify):
    """Sender-side refits over backend "direct" on the CPU stand-in (4 ranks, real gloo groups):
    with rx.Tuning(direct_prep_overlap=True) the transport runs the deferrable tensors' pre-pass
    itself (StagedRun's prep stream) and the plan skips them; every byte as the reference, two
    executes with changed sources, verify=True passing."""

    got = run_ranks(4, _fake_worker, kind, True, verify)
    assert any(d for per_rank in got for d in per_rank), got  # something was deferred somewhere


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_work_left_to_the_transport_runs_when_a_remap_rebuilds_its_executor(kind):
    """A remap after the headers rebuilds the executor; where the new one defers other work
    (here: none), what Plan already skipped for this execute runs on the caller's stream
    before the writes: every byte as the reference (it was never run: stale factors)."""

    got = run_ranks(4, _fake_worker, kind, True, False, True)
    assert any(d for per_rank in got for d in per_rank), got


# --- the real thing on GPUs (the lead runs them: 2 GPUs, reshard_ext built with CUDA) -----------

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NEEDS_2_GPUS = pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                                  reason="needs 2 GPUs and reshard_ext built with CUDA")


def gpu_worker(rank: int, world: int, kind: str, stage_bytes: int) -> dict:
    """Sender side over backend "direct" on 2 GPUs: TP1 -> TP1 (rank 0 -> rank 1) and TP2 -> TP1
    (ranks 0, 1 -> rank 1, whole and cut blocks), rx.Tuning(direct_prep_overlap=) off and on,
    each plan into its own buffers: the same bytes as the reference, hence as each other, for
    two executes with the sources changed in between, then a verified one and rx.verify."""
    dev = gpu_of(rank)
    specs = cases(kind, (0, 0), [0, 1], 1)
    names = sorted(specs)
    logical = _sources(specs, 0, kind)
    src = {n: (sl.local_part(logical[n], rank).to(dev), sl) for n, (sl, _) in specs.items() if rank in sl.mesh}
    plans, deferred = [], []
    for overlap in (False, True):
        dst = destinations(kind, specs, rank, dev)
        transform = FP8Block(names, where="sender") if kind == "fp8" else NVFP4(names, where="sender")
        options = rx.Options(tuning=rx.Tuning(direct_prep_overlap=overlap, direct_staging_bytes=stage_bytes))
        plan = rx.plan(src, dst, transform=transform, backend="direct", options=options)
        plans.append((plan, dst))
        deferred.append(sorted(item.name for item, _ in plan.transport.deferred))
    for step in range(3):
        if step:
            logical = _sources(specs, step, kind)
            for n, (t, sl) in src.items():
                t.copy_(sl.local_part(logical[n], rank))
        for overlap, (plan, dst) in enumerate(plans):
            rx.execute(plan, verify=step == 2)
            torch.cuda.synchronize()
            check(kind, specs, dst, logical, rank, f"overlap {bool(overlap)}, execute {step}")
    for plan, _ in plans:
        rx.verify(plan)
    return {"deferred": deferred, "routes": plans[1][0].routes}


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("stage_bytes", [64 << 10, 256 << 20])
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_deferred_prep_on_two_gpus(kind, stage_bytes):
    """Many chunks (a 64 KiB ring: the gates matter) and the default ring: with the knob on,
    rank 0 defers its TP1 tensors (and FP8's whole-block TP2 shard); the cut ones keep the pre-pass."""

    got = run_ranks(2, gpu_worker, kind, stage_bytes, backend="nccl")
    off, on = got[0]["deferred"]
    assert off == [] and "tp1.a" in on and "tp1.experts" in on and not any("cut" in n or "rows" in n for n in on), got
