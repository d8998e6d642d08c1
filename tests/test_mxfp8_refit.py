"""End-to-end MXFP8 refits over real gloo groups: the (data, scale) buffers equal
quantizing the whole logical tensor, byte for byte, refit after refit, in place."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from _dist import gpu_of, gpus_for, own_gpus, run_ranks
from test_mxfp8_kernels import assert_bytes_equal, make_case, ref_mxfp8, ref_swizzle

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard, mxfp8
from reshard_ext.mxfp8 import MXFP8, data_layout, scale_layout, scale_numel

BF16, F32 = torch.bfloat16, torch.float32
WORLD = 4


def _L(shape, mesh, placements, dtype=BF16) -> Layout:
    return Layout(shape, dtype, Mesh(mesh), placements)


def cases(world: int = 4, where: str = "sender") -> dict[str, tuple[Layout, Layout]]:
    """name -> (src layout, dst layout), for a world of 4 (or 2, or 1). BF16 unless named
    fp32; where="receiver" adds a source sharded off the 32-grid (the sender rejects it)."""
    if world == 1:
        return cases_one()
    c = cases_two() if world == 2 else cases_four()
    last = world - 1
    # fp32 sources: the sender casts to BF16 on the wire; a same-rank copy reads fp32
    c["fp32"] = (_L((64, 128), [0], [Replicate()], F32), _L((64, 128), [last], [Replicate()]))
    c["fp32_local"] = (_L((64, 128), [0, 1], [Shard(0)], F32), _L((64, 128), [0, 1], [Shard(0)]))
    if where == "receiver":
        c["ragged_src"] = (_L((8, 96), list(range(world)), [Shard(1)]), _L((8, 96), [1], [Replicate()]))
    return c


def expected_path(name: str, where: str, layout_kind: str, backend: str = "auto") -> str:
    """Where the quantize runs for a case: "fused" into the boxes or "staged" (a BF16
    staging / wire tensor and a separate pass)."""
    if name == "partial":
        return "staged"  # K = 80: a partial final block
    if where == "sender":
        return "staged" if name.startswith("fp32") else "fused"
    if name in ("ragged_src", "fp32_local") or (name == "fp32" and backend == "direct"):
        return "staged"  # boxes that split blocks; a copy (or a direct write) that reads fp32
    return "fused"  # 2-D and swizzled scales alike


def cases_four() -> dict[str, tuple[Layout, Layout]]:
    c: dict[str, tuple[Layout, Layout]] = {}
    # TP2 -> TP1 (column parallel: rows; row parallel: columns in whole 32-blocks)
    c["tp2_tp1.col"] = (_L((130, 256), [0, 1], [Shard(0)]), _L((130, 256), [2], [Replicate()]))
    c["tp2_tp1.row"] = (_L((64, 256), [0, 1], [Shard(1)]), _L((64, 256), [3], [Replicate()]))
    # TP1 -> TP2
    c["tp1_tp2.col"] = (_L((96, 160), [0], [Replicate()]), _L((96, 160), [2, 3], [Shard(0)]))
    c["tp1_tp2.row"] = (_L((40, 256), [1], [Replicate()]), _L((40, 256), [2, 3], [Shard(1)]))
    # fused gate/up (stride 2) -> TP2 on the last dim; a partial final block (K = 80)
    c["strided"] = (_L((48, 256), [0, 1], [Shard(1, stride=2)]), _L((48, 256), [2, 3], [Shard(1)]))
    c["partial"] = (_L((33, 80), [0, 1], [Shard(0)]), _L((33, 80), [0, 1, 2, 3], [Shard(0)]))
    # DP replicas on both sides (collocated), 3-D with leading dims as M
    c["dp"] = (_L((4, 40, 64), [[0, 1], [2, 3]], [Replicate(), Shard(1)]),
               _L((4, 40, 64), [0, 1, 2, 3], [Replicate()]))
    # EP: per-expert tensors (EP2 -> EP4) and a stacked [E, M, K] (EP2 -> EP4)
    for e in range(4):
        c[f"experts.weight{e}"] = (_L((64, 96), [e // 2], [Replicate()]), _L((64, 96), [e], [Replicate()]))
    c["experts.w13"] = (_L((4, 32, 128), [0, 1], [Shard(0)]), _L((4, 32, 128), [0, 1, 2, 3], [Shard(0)]))
    return c


def cases_two() -> dict[str, tuple[Layout, Layout]]:
    """The same kinds on two ranks (2-GPU machines): every pair crosses or copies locally."""
    c: dict[str, tuple[Layout, Layout]] = {
        "tp2_tp1.col": (_L((130, 256), [0, 1], [Shard(0)]), _L((130, 256), [1], [Replicate()])),
        "tp2_tp1.row": (_L((64, 256), [0, 1], [Shard(1)]), _L((64, 256), [0], [Replicate()])),
        "tp1_tp2.col": (_L((96, 160), [0], [Replicate()]), _L((96, 160), [0, 1], [Shard(0)])),
        "tp1_tp2.row": (_L((40, 256), [1], [Replicate()]), _L((40, 256), [0, 1], [Shard(1)])),
        "strided": (_L((48, 256), [0, 1], [Shard(1, stride=2)]), _L((48, 256), [1, 0], [Shard(1)])),
        "partial": (_L((33, 80), [0, 1], [Shard(0)]), _L((33, 80), [1, 0], [Shard(0)])),
        "dp": (_L((4, 40, 64), [[0], [1]], [Replicate(), Shard(1)]), _L((4, 40, 64), [0, 1], [Replicate()])),
        "experts.w13": (_L((4, 32, 128), [0, 1], [Shard(0)]), _L((4, 32, 128), [1, 0], [Shard(0)])),
    }
    for e in range(4):
        c[f"experts.weight{e}"] = (_L((64, 96), [e % 2], [Replicate()]), _L((64, 96), [(e + 1) % 2], [Replicate()]))
    return c


def cases_one() -> dict[str, tuple[Layout, Layout]]:
    """One rank (a 1-GPU machine): every box is a same-rank copy, folded to one run
    over whole rows where source and destination are both contiguous."""
    one = [0]
    return {
        "rows": (_L((130, 256), one, [Replicate()]), _L((130, 256), one, [Replicate()])),
        "dp": (_L((4, 40, 64), one, [Replicate()]), _L((4, 40, 64), one, [Replicate()])),
        "partial": (_L((33, 80), one, [Replicate()]), _L((33, 80), one, [Replicate()])),
        "fp32_local": (_L((64, 128), one, [Replicate()], F32), _L((64, 128), one, [Replicate()])),
    }


def _poison(n: int, seed: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g)


def _global(name: str, shape, step: int) -> torch.Tensor:
    kind = ("wide", "boundary", "normal", "zeros")[(len(name) + step) % 4]
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    x = make_case(kind, rows=rows, cols=-(-cols // 32) * 32, seed=(zlib.crc32(name.encode()) + 31 * step) % 10007)
    return x[:, :cols].contiguous().reshape(shape)


def refit_worker(rank: int, world: int, where: str, layout_kind: str, rounding: str, device: str = "cpu",
                 direct_bytes: int = 0, backend: str = "auto", shared: bool = False, verify: bool = False,
                 options: dict | None = None) -> dict:
    """shared: the destinations live in memory other processes can map (the CPU stand-in of
    the direct transport, tests/_direct_fake.py), and only the cases whose receiver pieces
    are fused run (a staged piece's staging is private memory). verify: every execute
    verified, then rx.verify. options: more rx.Tuning fields."""
    dev = gpu_of(rank) if device == "cuda" else torch.device("cpu")
    specs = cases(world, where)
    if shared:
        from _direct_fake import shared_poison

        specs = {n: v for n, v in specs.items() if expected_path(n, where, layout_kind, backend) == "fused"}

    def place(t: torch.Tensor) -> torch.Tensor:
        return shared_poison(tuple(t.shape), t.dtype).copy_(t) if shared else t.to(dev)
    names = sorted(specs)
    transform = MXFP8(params=names, scale_layout=layout_kind, where=where, rounding=rounding)
    mxfp8.PATHS.clear()
    torch.manual_seed(0)
    globals_ = {n: _global(n, specs[n][0].shape, 0) for n in names}
    bias_global = torch.arange(12, dtype=F32)
    src, dst = {}, {}
    for n in names:
        sl, dl = specs[n]
        if rank in sl.mesh:
            src[n] = (sl.local_part(globals_[n], rank).to(dev, sl.dtype), sl)
        if rank in dl.mesh:
            local = dl.local_shape(rank)
            # poisoned (never 0): every byte the refit leaves alone or zeroes is visible
            data = place(_poison(math.prod(local), n + "data")).view(torch.float8_e4m3fn).view(local)
            if layout_kind == "2d":
                scale = place(_poison(math.prod(local[:-1]) * -(-local[-1] // 32), n).view(
                    local[:-1] + (-(-local[-1] // 32),)))
            else:
                scale = place(_poison(scale_numel(local, "swizzled"), n))
            dst[n] = ((data, scale), dl)
    # an unconverted tensor passes through untouched
    bl_src, bl_dst = _L((12,), [0], [Replicate()], F32), _L((12,), list(range(world)), [Shard(0)], F32)
    if rank == 0:
        src["bias"] = (bias_global.clone().to(dev), bl_src)
    bias_out = place(torch.empty(bl_dst.local_shape(rank), dtype=F32))
    dst["bias"] = (bias_out, bl_dst)

    # small direct_bytes: ops travel straight from/into tensors
    plan = rx.plan(src, dst, transform=transform, backend=backend,
                   options=rx.Options(tuning=rx.Tuning(direct_bytes=direct_bytes or None, **(options or {}))))
    side = "src" if where == "sender" else "dst"
    for n in names:
        if rank in specs[n][side == "dst"].mesh:
            # the plan's own backend: "auto" may be direct (RESHARD_EXT_AUTO_DIRECT)
            assert mxfp8.PATHS[(side, n)] == expected_path(n, where, layout_kind, plan.backend), (n, mxfp8.PATHS)
        if side == "dst" and n in dst and layout_kind == "swizzled" and mxfp8.PATHS[(side, n)] == "fused":
            # binding zeroes the padding of a fused swizzled buffer (the boxes never write
            # it) and leaves its scales alone (an engine may read them until the refit)
            local = dst[n][1].local_shape(rank)
            real = ref_swizzle(torch.ones(math.prod(local[:-1]), -(-local[-1] // 32), dtype=torch.uint8)) == 1
            scale, poisoned = dst[n][0][1].cpu(), _poison(scale_numel(local, "swizzled"), n)
            assert_bytes_equal(scale, torch.where(real, poisoned, 0), f"{n} scale after bind")
    converted = {n: e for n, e in dst.items() if n != "bias"}
    ptrs = {n: (d.data_ptr(), s.data_ptr()) for n, ((d, s), _) in converted.items()}
    for step in range(2):
        if step:
            globals_ = {n: _global(n, specs[n][0].shape, step) for n in names}
            for n, (t, sl) in src.items():
                if n != "bias":
                    t.copy_(sl.local_part(globals_[n], rank))  # in place, as an optimizer does
        rx.execute(plan, verify=verify)
        for n, ((data, scale), dl) in converted.items():
            want_d, want_s = ref_mxfp8(globals_[n], rounding, "2d")
            assert (data.data_ptr(), scale.data_ptr()) == ptrs[n], f"{n}: buffers moved"
            assert_bytes_equal(data.view(torch.uint8), data_layout(dl).with_dtype(torch.uint8).local_part(
                want_d, rank), f"{n} data step {step}")
            piece = scale_layout(n, dl).local_part(want_s, rank)
            if layout_kind == "swizzled":
                piece = ref_swizzle(piece.reshape(-1, piece.shape[-1]))
            assert_bytes_equal(scale, piece, f"{n} scale step {step}")
        assert torch.equal(bias_out.cpu(), bl_dst.local_part(bias_global, rank))
    if verify:
        rx.verify(plan)
    return {"sent": plan.bytes_sent, "paths": dict(mxfp8.PATHS), "routes": plan.routes,
            "staging": plan.staging_bytes,
            "direct_peers": plan.transport.direct_peers if plan.backend == "direct" else []}


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_matrix(where, layout_kind, rounding):
    run_ranks(WORLD, refit_worker, where, layout_kind, rounding)


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_direct_messages(where):
    """Every op big enough to travel as its own message: fused boxes are never sent
    as flat bytes of the tensor, they still pack and unpack."""
    run_ranks(WORLD, refit_worker, where, "2d", "ceil", "cpu", 1)


def _fake_direct_worker(rank: int, world: int, layout_kind: str, where: str = "receiver", verify: bool = False,
                        options: dict | None = None) -> dict:
    from _direct_fake import release_shared, use_fake_device

    use_fake_device()
    try:
        return refit_worker(rank, world, where, layout_kind, "ceil", backend="direct", shared=True, verify=verify,
                            options=options)
    finally:
        release_shared()


@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
def test_refit_fused_receiver_over_direct_transport(layout_kind):
    """backend "direct" on the CPU stand-in of the device: senders quantize straight into
    the receivers' mapped data buffers and place the scales in their mapped scale buffers,
    whose addresses each receiver sent in its TensorRefs (ptr and side, translated)."""
    got = run_ranks(WORLD, _fake_direct_worker, layout_kind)
    assert all(r["direct_peers"] == [p for p in range(WORLD) if p != rank] for rank, r in enumerate(got)), got


@pytest.mark.parametrize("verify", [False, True])
def test_refit_sender_side_over_direct_transport_stages_its_boxes(verify):
    """backend "direct" on the CPU stand-in, sender side: each sender quantizes its boxes into
    a staging ring of 4 KiB (ops cut to fit its 1 KiB slots) and copies them on into the
    receivers' mapped buffers, verified or not, twice, byte for byte."""
    got = run_ranks(WORLD, _fake_direct_worker, "2d", "sender", verify, {"direct_staging_bytes": 4096})
    assert all(r["direct_peers"] == [p for p in range(WORLD) if p != rank] for rank, r in enumerate(got)), got
    staged = [r for r in got if "codec boxes staged" in r["routes"]]
    assert staged and all(0 < r["staging"] <= 4096 for r in staged), [(r["routes"], r["staging"]) for r in got]


def bytes_worker(rank: int, world: int, where: str) -> int:
    """TP2 on ranks 0,1 -> TP2 (other dim) on ranks 2,3: every byte crosses ranks."""
    sl = _L((256, 1024), [0, 1], [Shard(0)])
    dl = _L((256, 1024), [2, 3], [Shard(1)])
    g = _global("w", sl.shape, 0)
    src = {"w": (sl.local_part(g, rank), sl)} if rank in sl.mesh else {}
    dst = {}
    if rank in dl.mesh:
        local = dl.local_shape(rank)
        dst["w"] = ((torch.empty(local, dtype=torch.float8_e4m3fn),
                     torch.empty(local[:-1] + (local[-1] // 32,), dtype=torch.uint8)), dl)
    plan = rx.plan(src, dst, transform=MXFP8(["w"], where=where))
    rx.execute(plan)
    if dst:
        (data, scale), _ = dst["w"]
        want_d, want_s = ref_mxfp8(g, "ceil")
        assert_bytes_equal(data.view(torch.uint8), dl.with_dtype(torch.uint8).local_part(want_d, rank), "data")
    return plan.bytes_sent


def test_sender_side_halves_the_wire():
    recv = sum(run_ranks(WORLD, bytes_worker, "receiver"))
    send = sum(run_ranks(WORLD, bytes_worker, "sender"))
    assert recv == 256 * 1024 * 2
    assert send == 256 * 1024 + 256 * 1024 // 32
    assert send <= 0.53 * recv


def misaligned_worker(rank: int, world: int, where: str) -> str:
    # every rank holds a piece on both sides, so every rank sees the error
    sl = _L((8, 96), [0, 1, 2, 3], [Shard(1)])    # 24 columns each: not whole 32-blocks
    dl = _L((8, 96), [0, 1, 2, 3], [Replicate()])
    g = _global("bad", sl.shape, 0)
    if where == "receiver":
        sl, dl = dl, sl
    src = {"bad": (sl.local_part(g, rank), sl)}
    local = dl.local_shape(rank)
    dst = {"bad": ((torch.empty(local, dtype=torch.float8_e4m3fn), torch.empty(8 * 3, dtype=torch.uint8)), dl)}
    try:
        rx.plan(src, dst, transform=MXFP8(["bad"], where=where))
    except rx.ReshardError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_misaligned_last_dim_is_rejected(where):
    for msg in run_ranks(WORLD, misaligned_worker, where):
        assert "'bad'" in msg and "32-element" in msg, msg


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_matrix_two_ranks(where):
    """The 2-rank cases (what a 2-GPU machine runs) on CPU first."""
    for layout_kind in ("2d", "swizzled"):
        run_ranks(2, refit_worker, where, layout_kind, "ceil")


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_one_rank(where):
    """Same-rank copies only, on CPU first (what test_refit_one_gpu runs)."""
    for layout_kind in ("2d", "swizzled"):
        run_ranks(1, refit_worker, where, layout_kind, "ceil")


@pytest.mark.gpu
@pytest.mark.skipif(not (gpus_for(1) and rx.build_info()["cuda"]), reason="needs a GPU and reshard_ext built with CUDA")
@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_one_gpu(where, layout_kind):
    """The fused copy boxes on one GPU, with the swizzled padding zeroed on the device."""
    for rounding in ("ceil", "floor"):
        run_ranks(1, refit_worker, where, layout_kind, rounding, "cuda", backend="nccl")


@pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                    reason="needs 2 GPUs and reshard_ext built with CUDA")
@pytest.mark.parametrize("backend", ["nccl", "direct", "nvshmem"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_matrix_cuda(where, layout_kind, world, backend):
    """backend "direct": the sender's boxes write (and quantize) straight into the receiver;
    "nvshmem": the NCCL path's boxes around put-with-signal."""
    own_gpus(backend)
    if not gpus_for(world):
        pytest.skip(f"needs {world} GPUs")
    for rounding in ("ceil", "floor"):
        run_ranks(world, refit_worker, where, layout_kind, rounding, "cuda", 0, backend, backend="nccl")


@pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                    reason="needs 2 GPUs and reshard_ext built with CUDA")
@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
def test_sender_side_through_a_small_staging_ring_cuda(layout_kind, verify):
    """backend "direct" on 2 GPUs with a 4 KiB staging ring: the senders' codec boxes cut to
    its 1 KiB slots, the ring wrapping many times per execute, verified or not."""
    got = run_ranks(2, refit_worker, "sender", layout_kind, "ceil", "cuda", 0, "direct", False, verify,
                    {"direct_staging_bytes": 4096}, backend="nccl")
    assert all(r["direct_peers"] == [1 - rank] for rank, r in enumerate(got)), got
    assert any("codec boxes staged" in r["routes"] for r in got), [r["routes"] for r in got]
