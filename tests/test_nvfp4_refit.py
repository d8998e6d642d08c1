"""End-to-end NVFP4 refits over real gloo groups: the (data, scale, tensor_scale) buffers
equal torchao's NVFP4 of the whole logical tensor, byte for byte, refit after refit, in
place; the layouts it cannot quantize exactly raise on every rank before data moves."""
from __future__ import annotations

import math

import pytest
import torch
from _dist import gpu_of, gpus_for, run_ranks
from _nvfp4_ref import make_case, ref_nvfp4

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard
from reshard_ext.codecs import nvfp4
from reshard_ext.codecs.nvfp4 import scale_numel
from reshard_ext.nvfp4 import NVFP4, coarse_layout

BF16, F32 = torch.bfloat16, torch.float32
CPU = torch.device("cpu")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = 4
KINDS = ("normal", "wide", "zero_blocks", "inf", "bits", "tiny", "nan", "all_zero")


def _L(shape, mesh, placements, dtype=BF16) -> Layout:
    return Layout(shape, dtype, Mesh(mesh), placements)


def cases(where: str, world: int = WORLD) -> dict[str, tuple[Layout, Layout]]:
    """name -> (src layout, dst layout) on 4 ranks (or 2): TP rows and columns both ways,
    TP2 -> TP4, strided (fused gate/up), uneven rows, DP replicas, EP per-expert and
    stacked, 3-D, an fp32 source. Sources sharded every way, so the per-tensor scale must
    come from the global amax. where="receiver" adds sources cut inside 16-blocks (BF16 on
    the wire: only the receivers' pieces must be whole blocks)."""
    if world == 2:
        c = {
            "tp2_tp1.col": (_L((130, 256), [0, 1], [Shard(0)]), _L((130, 256), [1], [Replicate()])),
            "tp2_tp1.row": (_L((64, 256), [0, 1], [Shard(1)]), _L((64, 256), [0], [Replicate()])),
            "tp1_tp2.row": (_L((40, 256), [1], [Replicate()]), _L((40, 256), [0, 1], [Shard(1)])),
            "strided": (_L((48, 256), [0, 1], [Shard(1, stride=2)]), _L((48, 256), [1, 0], [Shard(1)])),
            "uneven": (_L((33, 80), [0, 1], [Shard(0)]), _L((33, 80), [1, 0], [Shard(0)])),
            "experts.w13": (_L((4, 32, 128), [0, 1], [Shard(0)]), _L((4, 32, 128), [1, 0], [Shard(0)])),
            "fp32": (_L((64, 128), [0, 1], [Shard(0)], F32), _L((64, 128), [1], [Replicate()])),
        }
        if where == "receiver":
            c["ragged_src"] = (_L((8, 96), [0, 1], [Shard(1)]), _L((8, 96), [1], [Replicate()]))  # 48: 3 blocks
        return c
    every = list(range(world))
    c = {
        "tp2_tp1.col": (_L((130, 256), [0, 1], [Shard(0)]), _L((130, 256), [2], [Replicate()])),
        "tp2_tp1.row": (_L((64, 256), [0, 1], [Shard(1)]), _L((64, 256), [3], [Replicate()])),
        "tp1_tp2.col": (_L((96, 160), [0], [Replicate()]), _L((96, 160), [2, 3], [Shard(0)])),
        "tp1_tp2.row": (_L((40, 256), [1], [Replicate()]), _L((40, 256), [2, 3], [Shard(1)])),
        "tp2_tp4": (_L((128, 128), [2, 3], [Shard(0)]), _L((128, 128), every, [Shard(1)])),
        "strided": (_L((48, 256), [0, 1], [Shard(1, stride=2)]), _L((48, 256), [2, 3], [Shard(1)])),
        "uneven": (_L((33, 80), [0, 1, 2], [Shard(0)]), _L((33, 80), every, [Shard(0)])),  # 11 rows; 9, 9, 9, 6
        "empty_piece": (_L((3, 64), every, [Shard(0)]), _L((3, 64), [2], [Replicate()])),  # rank 3 holds no row
        "dp": (_L((4, 40, 64), [[0, 1], [2, 3]], [Replicate(), Shard(1)]), _L((4, 40, 64), every, [Replicate()])),
        "experts.w13": (_L((4, 32, 128), [0, 1], [Shard(0)]), _L((4, 32, 128), every, [Shard(0)])),
        "fp32": (_L((64, 128), [0, 1], [Shard(0)], F32), _L((64, 128), [3], [Replicate()])),
        # uneven shards of the last dim in whole blocks (an engine's TP split of an odd K)
        "uneven_cols": (_L((32, 160), [0, 1], [Shard(1, sizes=(112, 48))]),
                        _L((32, 160), [2, 3], [Shard(1, sizes=(48, 112))])),
    }
    for e in range(4):  # per-expert tensors, EP2 -> EP4
        c[f"experts.weight{e}"] = (_L((64, 96), [e // 2], [Replicate()]), _L((64, 96), [e], [Replicate()]))
    if where == "receiver":
        c["ragged_src"] = (_L((8, 96), every, [Shard(1)]), _L((8, 96), [1], [Replicate()]))  # 24 columns each
    return c


def _global(name: str, layout: Layout, step: int) -> torch.Tensor:
    kind = KINDS[(len(name) + 3 * step) % len(KINDS)]
    return make_case(kind, tuple(layout.shape), f"{name}{step}").to(layout.dtype)


def _poison(n: int, seed: str) -> torch.Tensor:
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    return torch.randint(1, 255, (n,), dtype=torch.uint8, generator=g)


def _to_blocked(scale2d: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.utils import to_blocked

    return to_blocked(scale2d).view(torch.uint8)


def destination(name: str, layout: Layout, rank: int, scale_layout: str, dev: torch.device = CPU):
    """Poisoned (data, scale, tensor_scale) buffers of this rank's piece."""
    local = layout.local_shape(rank)
    data = _poison(math.prod(local) // 2, name + "d").view(local[:-1] + (local[-1] // 2,))
    n = scale_numel(local, scale_layout)
    scale = _poison(n, name + "s").view(torch.float8_e4m3fn)
    if scale_layout == "2d":
        scale = scale.view(local[:-1] + (local[-1] // 16,))
    return data.to(dev), scale.to(dev), torch.tensor(float("nan"), device=dev)


def check(name: str, layout: Layout, rank: int, got, want, scale_layout: str, what: str) -> None:
    data, scale, tscale = (t.cpu() for t in got)
    want_d, want_s, want_p = want
    shape = tuple(layout.shape)
    packed = coarse_layout(name, layout, 2, torch.uint8).local_part(want_d.view(shape[:-1] + (-1,)), rank)
    assert torch.equal(data.view(torch.uint8), packed), f"{what}: {name} data"
    s2d = coarse_layout(name, layout, 16, torch.uint8).local_part(want_s.view(shape[:-1] + (-1,)), rank)
    if scale_layout == "swizzled":
        s2d = _to_blocked(s2d.reshape(-1, s2d.shape[-1]))
    assert torch.equal(scale.view(torch.uint8).reshape(-1), s2d.reshape(-1)), f"{what}: {name} scale"
    assert tscale.view(torch.int32).item() == want_p.item(), f"{what}: {name} tensor scale"


def refit_worker(rank: int, world: int, where: str, scale_layout: str, verify: bool = False,
                 device: str = "cpu", backend: str = "auto", shared: bool = False) -> int:
    """shared: the destinations live in memory other processes can map (the CPU stand-in of
    the direct transport, tests/_direct_fake.py)."""
    dev = gpu_of(rank) if device == "cuda" else CPU
    specs = cases(where, world)
    names = sorted(specs)
    globals_ = {n: _global(n, specs[n][0], 0) for n in names}
    src, dst = {}, {}
    for n in names:
        sl, dl = specs[n]
        if rank in sl.mesh:
            src[n] = (sl.local_part(globals_[n], rank).to(dev), sl)
        if rank in dl.mesh:
            bufs = destination(n, dl, rank, scale_layout, dev)
            if shared:
                from _direct_fake import shared_poison

                bufs = tuple(shared_poison(tuple(t.shape), t.dtype).copy_(t) for t in bufs)
            dst[n] = (bufs, dl)
    bias_src, bias_dst = _L((12,), [0], [Replicate()], F32), _L((12,), list(range(world)), [Shard(0)], F32)
    bias = torch.arange(12, dtype=F32)
    if rank == 0:
        src["bias"] = (bias.clone().to(dev), bias_src)  # an unconverted tensor passes through untouched
    bias_out = torch.empty(bias_dst.local_shape(rank), dtype=F32, device=dev)
    if shared:
        from _direct_fake import shared_poison

        bias_out = shared_poison(tuple(bias_out.shape), F32)
    dst["bias"] = (bias_out, bias_dst)
    nvfp4.PATHS.clear()
    plan = rx.plan(src, dst, transform=NVFP4(names, scale_layout=scale_layout, where=where), backend=backend)
    if where == "sender":  # BF16 sources are quantized inside the pack and copy boxes; fp32 ones staged
        assert {n: nvfp4.PATHS[("src", n)] for n in src if n != "bias"} == \
            {n: "staged" if n == "fp32" else "fused" for n in src if n != "bias"}, nvfp4.PATHS
    ptrs = {n: tuple(t.data_ptr() for t in bufs) for n, (bufs, _) in dst.items() if n != "bias"}
    for step in range(2):
        if step:  # the sources change in place, as an optimizer's step does
            globals_ = {n: _global(n, specs[n][0], step) for n in names}
            for n, (t, sl) in src.items():
                if n != "bias":
                    t.copy_(sl.local_part(globals_[n], rank).to(dev))
        rx.execute(plan, verify=verify)
        for n, (bufs, dl) in dst.items():
            if n == "bias":
                continue
            assert tuple(t.data_ptr() for t in bufs) == ptrs[n], f"{n}: buffers moved"
            check(n, dl, rank, bufs, ref_nvfp4(globals_[n].to(BF16)), scale_layout,
                  f"rank {rank} step {step}")
        assert torch.equal(bias_out.cpu(), bias_dst.local_part(bias, rank))
    return plan.bytes_sent


@pytest.mark.parametrize("scale_layout", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_matrix(where, scale_layout):
    run_ranks(WORLD, refit_worker, where, scale_layout)


@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_two_ranks_verified(where):
    """The same kinds on two ranks, with verify=True: the digests cover the quantized
    bytes, block scales and per-tensor scale the receiver holds (sender side: what the
    wire carries; receiver side: the BF16 its quantize reads)."""
    run_ranks(2, refit_worker, where, "swizzled", True)


@pytest.mark.gpu
@pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                    reason="needs 2 GPUs and reshard_ext built with CUDA")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scale_layout", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_refit_matrix_cuda(where, scale_layout, world):
    """CUDA tensors over NCCL ("auto": the direct transport where it applies): the CUDA amax
    pre-pass and quantize kernels give torchao's CPU bytes; the second run verifies."""
    if not gpus_for(world):
        pytest.skip(f"needs {world} GPUs")
    for verify in (False, True):
        run_ranks(world, refit_worker, where, scale_layout, verify, "cuda", backend="nccl")


def bytes_worker(rank: int, world: int, transform: bool) -> int:
    """TP1 on rank 0 -> TP2 (columns) on ranks 2, 3: every byte crosses ranks."""
    sl, dl = _L((256, 1024), [0], [Replicate()]), _L((256, 1024), [2, 3], [Shard(1)])
    g = _global("w", sl, 0)
    src = {"w": (g, sl)} if rank == 0 else {}
    dst = {}
    if rank in dl.mesh:
        dst["w"] = (destination("w", dl, rank, "2d") if transform else torch.empty(dl.local_shape(rank), dtype=BF16),
                    dl)
    plan = rx.plan(src, dst, transform=NVFP4(["w"], where="sender") if transform else None)
    rx.execute(plan)
    if dst and transform:
        check("w", dl, rank, dst["w"][0], ref_nvfp4(g), "2d", "bytes")
    return plan.bytes_sent


def test_sender_side_wire_bytes():
    """Packed data + E4M3 scales + one float per receiving rank: 28.1% of the BF16 refit."""
    bf16 = sum(run_ranks(WORLD, bytes_worker, False))
    sent = sum(run_ranks(WORLD, bytes_worker, True))
    assert bf16 == 256 * 1024 * 2
    assert sent == 256 * 1024 // 2 + 256 * 1024 // 16 + 2 * 4
    assert sent <= 0.29 * bf16


def rejected_worker(rank: int, world: int, where: str, case: str) -> str:
    """Every rank holds a piece on both sides, so every rank must see the error. The
    quantizing side (the source for "sender", the destination for "receiver") holds
    pieces cut inside blocks (24 columns each), or whole tensors with K = 40."""
    every = list(range(world))
    shape = (8, 40) if case == "k40" else (8, 96)
    whole = _L(shape, every, [Replicate()])
    quantized = {"cut": _L(shape, every, [Shard(1)]), "k40": whole}[case]
    sl, dl = (quantized, whole) if where == "sender" else (whole, quantized)
    g = _global("bad", sl, 0)
    local = dl.local_shape(rank)
    k = local[-1]
    dst = {"bad": ((torch.empty(local[:-1] + (k // 2,), dtype=torch.uint8),
                    torch.empty(local[:-1] + (max(k // 16, 1),), dtype=torch.float8_e4m3fn), torch.empty(())), dl)}
    try:
        rx.plan({"bad": (sl.local_part(g, rank), sl)}, dst, transform=NVFP4(["bad"], where=where))
    except rx.ReshardError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case, words", [("cut", ["'bad'", "16-element blocks"]),
                                          ("k40", ["'bad'", "not a multiple of the 16-element block"])])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_what_cannot_be_quantized_exactly_is_rejected(where, case, words):
    """A piece cut inside a 16-element block, K not a multiple of 16 (torchao refuses it
    too): raised on every rank at plan time."""
    for msg in run_ranks(WORLD, rejected_worker, where, case):
        assert all(w in msg for w in words), msg


def bad_destination_worker(rank: int, world: int) -> list[str]:
    lay = _L((4, 64), [0], [Replicate()])
    x = _global("w", lay, 0)
    good = (torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.float8_e4m3fn), torch.empty(()))
    bad = {
        "a pair": good[:2],
        "wrong data size": (torch.empty(4, 64, dtype=torch.uint8),) + good[1:],
        "bf16 data": (torch.empty(4, 32, dtype=BF16),) + good[1:],
        "swizzled-size scales for 2-D": (good[0], torch.empty(512, dtype=torch.float8_e4m3fn), good[2]),
        "fp16 tensor scale": good[:2] + (torch.empty((), dtype=torch.float16),),
    }
    out = []
    for why, target in bad.items():
        try:
            rx.plan({"w": (x, lay)}, {"w": (target, lay)}, transform=NVFP4(["w"]))
            out.append(f"{why}: accepted")
        except rx.ReshardError as e:
            out.append(f"{why}: {e}")
    rx.execute(rx.plan({"w": (x, lay)}, {"w": (good, lay)}, transform=NVFP4(["w"])))
    check("w", lay, 0, good, ref_nvfp4(x), "2d", "good")
    return out


def test_bad_destinations_are_rejected():
    for msg in run_ranks(1, bad_destination_worker)[0]:
        assert "NVFP4" in msg and "'w'" in msg, msg
