"""End-to-end blockwise FP8 refits over real gloo groups (rx.FP8Block): the (data, scale_inv)
buffers equal quantizing the whole logical tensor (references of test_fp8block_kernels), byte
for byte, refit after refit, in place; source shards that cut 128x128 blocks get the global
block's amax; FP8 sources move with their scales; a destination that cuts a block raises."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
from _dist import gpu_of, gpus_for, own_gpus, run_ranks
from test_fp8block_kernels import assert_bytes, ref_fp8block, special_case

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard
from reshard_ext.codecs import fp8block as codec
from reshard_ext.fp8block import FP8Block

BF16, F32 = torch.bfloat16, torch.float32
WORLD = 4


def _L(shape, mesh, placements, dtype=BF16) -> Layout:
    return Layout(shape, dtype, Mesh(mesh), placements)


def cases(world: int) -> dict[str, tuple[Layout, Layout]]:
    """name -> (src layout, dst layout). Destinations hold whole blocks (engines' shards)."""
    if world == 1:
        one = [0]
        return {"rows": (_L((328, 428), one, [Replicate()]), _L((328, 428), one, [Replicate()])),
                "experts": (_L((3, 200, 256), one, [Replicate()]), _L((3, 200, 256), one, [Replicate()])),
                "fp32": (_L((256, 384), one, [Replicate()], F32), _L((256, 384), one, [Replicate()], F32))}
    last = world - 1
    c: dict[str, tuple[Layout, Layout]] = {
        # TP2 -> TP1 (column parallel: 64-row shards cut the 128-row blocks)
        "tp_cut_rows": (_L((128, 384), [0, 1], [Shard(0)]), _L((128, 384), [last], [Replicate()])),
        # TP1 -> TP2 and TP2 -> TP2 on the other dim, whole blocks
        "tp1_tp2": (_L((256, 256), [0], [Replicate()]), _L((256, 256), [0, 1], [Shard(0)])),
        "rows_to_cols": (_L((256, 512), [0, 1], [Shard(0)]), _L((256, 512), [1, 0], [Shard(1)])),
        # row parallel shards of 64 columns (cut), K = 300 not a multiple of the block (uneven: 150)
        "tp_cut_cols": (_L((136, 256), [0, 1], [Shard(1)]), _L((136, 256), [last], [Replicate()])),
        "k300": (_L((130, 300), [0, 1], [Shard(1)]), _L((130, 300), [0, 1], [Replicate()])),
        # uneven torch.chunk rows (67, 67, 66 / 33 x 3 + 31), cutting blocks
        "uneven": (_L((200, 256), list(range(min(world, 3))), [Shard(0)]), _L((200, 256), [0], [Replicate()])),
        # fused gate/up, stride 2: runs of 64 rows
        "strided": (_L((256, 128), [0, 1], [Shard(0, stride=2)]), _L((256, 128), [1, 0], [Shard(0)])),
        # FP32 masters
        "fp32": (_L((256, 384), [0, 1], [Shard(1)], F32), _L((256, 384), [last], [Replicate()], F32)),
        # EP2 -> EP1 on a stacked [E, N, K], blocks per expert
        "experts.w13": (_L((4, 136, 256), [0, 1], [Shard(0)]), _L((4, 136, 256), [last], [Replicate()])),
    }
    if world >= 4:
        # DP2 x TP2 replicas of 96-row shards (cut) -> every rank a replica
        c["dp_tp"] = (_L((192, 256), [[0, 1], [2, 3]], [Replicate(), Shard(0)]),
                      _L((192, 256), [0, 1, 2, 3], [Replicate()]))
        # uneven shard sizes (an engine's split): 64 | 136 rows (cut) -> 128 | 72 (whole blocks)
        c["sizes"] = (_L((200, 256), [0, 1], [Shard(0, sizes=(64, 136))]),
                      _L((200, 256), [2, 3], [Shard(0, sizes=(128, 72))]))
        # TP4 of 64 rows -> TP2 of 128
        c["tp4_tp2"] = (_L((256, 384), [0, 1, 2, 3], [Shard(0)]), _L((256, 384), [2, 3], [Shard(0)]))
        # per-expert tensors EP2 -> EP4
        for e in range(4):
            c[f"experts.weight{e}"] = (_L((256, 128), [e // 2], [Replicate()]), _L((256, 128), [e], [Replicate()]))
    return c


def _global(name: str, layout: Layout, step: int) -> torch.Tensor:
    return special_case(layout.shape, layout.dtype, seed=(zlib.crc32(name.encode()) + 31 * step) % 100003)


def _poison(n: int, seed: str, dtype=torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return torch.randint(1, 255, (n * (4 if dtype == F32 else 1),), dtype=torch.uint8, generator=g).view(dtype)


def refit_worker(rank: int, world: int, where: str, scales: str, verify: bool = False, device: str = "cpu",
                 backend: str = "auto", shared: bool = False) -> dict:
    """shared: the destinations live in memory other processes can map (the CPU stand-in of
    the direct transport, tests/_direct_fake.py)."""
    dev = gpu_of(rank) if device == "cuda" else torch.device("cpu")

    def place(t: torch.Tensor) -> torch.Tensor:
        if shared:
            from _direct_fake import shared_poison

            return shared_poison(tuple(t.shape), t.dtype).copy_(t)
        return t.to(dev)

    specs = cases(world)
    names = sorted(specs)
    codec.PATHS.clear()
    globals_ = {n: _global(n, specs[n][0], 0) for n in names}
    src, dst = {}, {}
    for n in names:
        sl, dl = specs[n]
        if rank in sl.mesh:
            src[n] = (sl.local_part(globals_[n], rank).to(dev), sl)
        if rank in dl.mesh:
            local = dl.local_shape(rank)
            slocal = codec.scale_layout(n, dl, "convert").local_shape(rank)
            data = place(_poison(math.prod(local), n + "d").view(torch.float8_e4m3fn).view(local))
            scale = place(_poison(math.prod(slocal), n + "s", F32).view(slocal))
            dst[n] = ((data, scale), dl)
    bias_src, bias_dst = _L((12,), [0], [Replicate()], F32), _L((12,), list(range(world)), [Shard(0)], F32)
    bias = torch.arange(12, dtype=F32)
    if rank == 0:
        src["bias"] = (bias.clone().to(dev), bias_src)
    bias_out = place(torch.zeros(bias_dst.local_shape(rank), dtype=F32))
    dst["bias"] = (bias_out, bias_dst)
    plan = rx.plan(src, dst, transform=FP8Block(names, scales=scales, where=where), backend=backend)
    converted = {n: e for n, e in dst.items() if n != "bias"}
    ptrs = {n: (d.data_ptr(), s.data_ptr()) for n, ((d, s), _) in converted.items()}
    for step in range(2):
        if step:  # the sources change in place, as an optimizer step does
            globals_ = {n: _global(n, specs[n][0], step) for n in names}
            for n, (t, sl) in src.items():
                if n != "bias":
                    t.copy_(sl.local_part(globals_[n], rank))
        rx.execute(plan, verify=verify)
        if device == "cuda":
            torch.cuda.synchronize()
        for n, ((data, scale), dl) in converted.items():
            want_d, want_s = ref_fp8block(globals_[n], scales)
            assert (data.data_ptr(), scale.data_ptr()) == ptrs[n], f"{n}: buffers moved"
            assert_bytes(data.cpu(), dl.with_dtype(torch.uint8).local_part(want_d, rank), f"{n} data step {step}")
            assert_bytes(scale.cpu(), codec.scale_layout(n, dl, "convert").local_part(want_s, rank),
                         f"{n} scale_inv step {step}")
        assert torch.equal(bias_out.cpu(), bias_dst.local_part(bias, rank))
    if verify:
        rx.verify(plan)
    return {"sent": plan.bytes_sent, "paths": dict(codec.PATHS)}


@pytest.mark.parametrize("scales", ["fp32", "pow2"])
@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_refit_matrix(where, scales):
    got = run_ranks(WORLD, refit_worker, where, scales)
    paths = {k: v for r in got for k, v in r["paths"].items()}
    if where == "sender":
        # fused unless K or the shards leave the 16-element items of the boxes
        assert paths[("src", "k300")] == "staged" and paths[("src", "tp_cut_rows")] == "fused", paths
    else:
        assert set(paths.values()) == {"staged"}, paths


@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_refit_verified(where):
    """verify=True covers what the receiver holds (the E4M3 bytes and scales on the wire, or
    the logical tensor the receiver quantizes), and rx.verify after it."""
    run_ranks(WORLD, refit_worker, where, "fp32", True)


@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_refit_two_ranks_and_one(where):
    run_ranks(2, refit_worker, where, "pow2")
    run_ranks(1, refit_worker, where, "fp32")


def _fake_direct_worker(rank: int, world: int, scales: str) -> dict:
    from _direct_fake import release_shared, use_fake_device

    use_fake_device()
    try:
        return refit_worker(rank, world, "sender", scales, backend="direct", shared=True)
    finally:
        release_shared()


@pytest.mark.parametrize("scales", ["fp32", "pow2"])
def test_refit_sender_over_direct_transport(scales):
    """backend "direct" on the CPU stand-in of the device: the senders' boxes quantize
    straight into the receivers' mapped data buffers, the scales land in theirs."""
    run_ranks(WORLD, _fake_direct_worker, scales)


def corrupt_worker(rank: int, world: int, where: str) -> str:
    """A destination byte changed after the refit: rx.verify raises on every rank, naming it."""
    sl, dl = _L((256, 512), [0, 1], [Shard(0)]), _L((256, 512), [2, 3], [Shard(1)])
    g = _global("w", sl, 0)
    src = {"w": (sl.local_part(g, rank), sl)} if rank in sl.mesh else {}
    dst = {}
    if rank in dl.mesh:
        local = dl.local_shape(rank)
        dst["w"] = ((torch.empty(local, dtype=torch.float8_e4m3fn), torch.empty(codec.scale_shape(local), dtype=F32)),
                    dl)
    plan = rx.plan(src, dst, transform=FP8Block(["w"], where=where))
    rx.execute(plan, verify=True)
    rx.verify(plan)
    if rank == 3:  # a scale_inv and an E4M3 byte the senders did not send
        data, scale = dst["w"][0]
        scale.view(torch.int32)[0, 0] ^= 1
        data.view(torch.uint8)[5, 7] ^= 1
    try:
        rx.verify(plan)
    except rx.ReshardError as e:
        return str(e)
    return ""


def test_verify_covers_data_and_scales():
    msgs = run_ranks(WORLD, corrupt_worker, "sender")
    assert all("'w::fp8.scale'" in m and "'w::fp8.data'" in m for m in msgs), msgs


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(not (gpus_for(1) and rx.build_info()["cuda"]), reason="needs a GPU and reshard_ext built with CUDA")
@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_refit_one_gpu(where):
    for scales in ("fp32", "pow2"):
        run_ranks(1, refit_worker, where, scales, True, "cuda", "nccl", backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                    reason="needs 2 GPUs and reshard_ext built with CUDA")
@pytest.mark.parametrize("backend", ["nccl", "direct", "nvshmem"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_refit_matrix_cuda(where, world, backend):
    """backend "direct": the sender's boxes quantize straight into the receiver's memory."""
    own_gpus(backend)
    if not gpus_for(world):
        pytest.skip(f"needs {world} GPUs")
    for scales in ("fp32", "pow2"):
        run_ranks(world, refit_worker, where, scales, scales == "fp32", "cuda", backend, backend="nccl")


def bytes_worker(rank: int, world: int, where: str) -> int:
    """TP2 on ranks 0,1 -> TP2 on the other dim on ranks 2,3: every byte crosses ranks."""
    sl, dl = _L((512, 1024), [0, 1], [Shard(0)]), _L((512, 1024), [2, 3], [Shard(1)])
    g = _global("w", sl, 0)
    src = {"w": (sl.local_part(g, rank), sl)} if rank in sl.mesh else {}
    dst = {}
    if rank in dl.mesh:
        local = dl.local_shape(rank)
        dst["w"] = ((torch.empty(local, dtype=torch.float8_e4m3fn),
                     torch.empty(codec.scale_shape(local), dtype=F32)), dl)
    plan = rx.plan(src, dst, transform=FP8Block(["w"], where=where))
    rx.execute(plan)
    return plan.bytes_sent


def test_sender_side_wire_bytes():
    recv = sum(run_ranks(WORLD, bytes_worker, "receiver"))
    send = sum(run_ranks(WORLD, bytes_worker, "sender"))
    assert recv == 512 * 1024 * 2
    assert send == 512 * 1024 + (512 // 128) * (1024 // 128) * 4
    print(f"\nblockwise FP8, sender-side wire bytes: {send / recv:.4f} of BF16 (data + scales)")
    assert send <= 0.51 * recv


def cut_dst_worker(rank: int, world: int, where: str, fp8_source: bool) -> tuple[str, bool]:
    """A destination of 64-row shards cuts the 128-row blocks: every rank raises before data moves."""
    sl, dl = _L((256, 256), [0, 1], [Shard(0)]), _L((256, 256), [0, 1, 2, 3], [Shard(0)])
    g = _global("cut", sl, 0)
    if fp8_source:
        d, s = ref_fp8block(g, "fp32")
        sl = sl.with_dtype(torch.float8_e4m3fn)
        src_t: object = None
        if rank in sl.mesh:
            src_t = (sl.with_dtype(torch.uint8).local_part(d, rank),
                     codec.scale_layout("cut", sl, "x").local_part(s, rank))
    else:
        src_t = sl.local_part(g, rank) if rank in sl.mesh else None
    src = {"cut": (src_t, sl)} if src_t is not None else {}
    local = dl.local_shape(rank)
    data = torch.full(local, 7, dtype=torch.uint8)
    scale = torch.full((1, 2), 3.0)
    dst = {"cut": ((data.view(torch.float8_e4m3fn), scale), dl)}
    try:
        rx.plan(src, dst, transform=FP8Block(["cut"], where=where))
    except rx.ReshardError as e:
        return str(e), bool((data == 7).all() and (scale == 3.0).all())
    return "", False


@pytest.mark.parametrize("fp8_source", [False, True])
@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_destination_cutting_a_block_raises_on_every_rank(where, fp8_source):
    if fp8_source and where == "receiver":
        pytest.skip("an FP8 source needs where='sender'")
    for msg, untouched in run_ranks(WORLD, cut_dst_worker, where, fp8_source):
        assert "'cut'" in msg and "index 64 of dim 0" in msg and "block [0, 128)" in msg, msg
        assert untouched


# ---- FP8 -> FP8: sources already quantized, moved with their scales ------------------------

def fp8_worker(rank: int, world: int, case: str) -> None:
    if case == "tp2_tp4":
        sl = _L((512, 384), [0, 1], [Shard(0)], torch.float8_e4m3fn)
        dl = _L((512, 384), [0, 1, 2, 3], [Shard(0)], torch.float8_e4m3fn)
    else:  # EP2 -> EP1 on stacked experts (and rows of K cut at 384 + 16: a partial block)
        sl = _L((4, 256, 400), [0, 1], [Shard(0)], torch.float8_e4m3fn)
        dl = _L((4, 256, 400), [2], [Replicate()], torch.float8_e4m3fn)
    for step in range(2):
        g = special_case(sl.shape, BF16, seed=11 + step)
        data, scale = ref_fp8block(g, "pow2" if step else "fp32")  # quantized once, on the trainer
        ssl, sdl = codec.scale_layout(case, sl, "x"), codec.scale_layout(case, dl, "x")
        if step == 0:
            src_pair = (sl.with_dtype(torch.uint8).local_part(data, rank).view(torch.float8_e4m3fn),
                        ssl.local_part(scale, rank)) if rank in sl.mesh else None
            src = {case: (src_pair, sl)} if src_pair is not None else {}
            dst = {}
            if rank in dl.mesh:
                dst[case] = ((torch.zeros(dl.local_shape(rank), dtype=torch.float8_e4m3fn),
                              torch.zeros(sdl.local_shape(rank), dtype=F32)), dl)
            plan = rx.plan(src, dst, transform=FP8Block([case], where="sender"))
        elif src:
            d, s = src[case][0]
            d.copy_(sl.with_dtype(torch.uint8).local_part(data, rank).view(torch.float8_e4m3fn))
            s.copy_(ssl.local_part(scale, rank))
        rx.execute(plan, verify=True)
        if dst:
            (d, s), _ = dst[case]
            assert_bytes(d, dl.with_dtype(torch.uint8).local_part(data, rank), f"{case} data {step}")
            assert_bytes(s, sdl.local_part(scale, rank), f"{case} scale_inv {step}")


@pytest.mark.parametrize("case", ["tp2_tp4", "ep2_ep1"])
def test_fp8_sources_move_with_their_scales(case):
    run_ranks(WORLD, fp8_worker, case)


def fp8_receiver_worker(rank: int, world: int) -> str:
    sl = _L((256, 256), [0, 1], [Shard(0)], torch.float8_e4m3fn)
    dl = _L((256, 256), [2, 3], [Shard(0)], torch.float8_e4m3fn)
    src = {"w": ((torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.zeros(1, 2)), sl)} if rank < 2 else {}
    dst = {"w": ((torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.zeros(1, 2)), dl)} if rank >= 2 else {}
    try:
        rx.plan(src, dst, transform=FP8Block(["w"], where="receiver"))
    except rx.ReshardError as e:
        return str(e)
    return ""


def test_fp8_source_with_receiver_side_raises():
    for msg in run_ranks(WORLD, fp8_receiver_worker):
        assert "'w'" in msg and "where='sender'" in msg, msg


def registry_worker(rank: int, world: int, name: str, where: str) -> int:
    """A benchmark's loop over rx formats: each makes its transform and its destinations."""
    from reshard_ext import formats

    fmt = formats.get(name)
    sl, dl = _L((256, 512), [0, 1], [Shard(0)]), _L((256, 512), [2, 3], [Shard(1)])
    g = _global("w", sl, 0)
    src = {"w": (sl.local_part(g, rank), sl)} if rank in sl.mesh else {}
    dst = {"w": (fmt.buffers(dl.local_shape(rank), "cpu"), dl)} if rank in dl.mesh else {}
    plan = rx.plan(src, dst, transform=fmt.make(["w"], where))
    rx.execute(plan)
    return plan.bytes_sent


@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_format_registry(where):
    from reshard_ext import formats

    assert set(formats.FORMATS) >= {"mxfp8", "fp8block"}
    for name, fmt in formats.FORMATS.items():
        sent = sum(run_ranks(WORLD, registry_worker, name, where))
        receivers = 2
        assert sent == round(256 * 512 * fmt.wire_bytes(where)) + receivers * fmt.tensor_bytes, (name, where, sent)
