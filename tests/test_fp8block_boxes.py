"""Blockwise FP8 fused into the box kernels (codec RX_CODEC_FP8BLOCK: a source piece read in
place and quantized under its blocks' precomputed factors) against the whole-tensor
reference of test_fp8block_kernels, on three backends that must agree:
  twin:     the CPU twin (copy_boxes_cpu), the data path of the gloo refit;
  emulated: the CUDA kernel's own per-lane code run on the host (any CUDA build);
  cuda:     the real kernel on a GPU (skipped without one).
The piece is a TP shard of 256 rows starting at row 64 of the global tensor, so its boxes
cross the global blocks' boundaries; every output byte outside the boxes keeps its poison."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from _boxes import assert_box_plans, assert_box_refused, table
from test_fp8block_kernels import assert_bytes, quantize_whole, ref_fp8block, special_case

from reshard_ext import _C
from reshard_ext.codecs import fp8block as codec
from reshard_ext.layout import code_of

HAVE_KERNEL = hasattr(_C, "DeviceBoxTable")
HAVE_GPU = HAVE_KERNEL and torch.cuda.is_available()
BACKENDS = [
    "twin",
    pytest.param("emulated", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]),
]
BF16, F32 = torch.bfloat16, torch.float32
U8, E4M3 = code_of(torch.uint8), code_of(torch.float8_e4m3fn)
N, K, ROW0, ROWS = 384, 448, 64, 256  # the global tensor; the piece: rows [64, 320)


def run(backend: str, build, bufs: dict[str, torch.Tensor], digest_pass: int = 0) -> tuple[dict, list]:
    """Runs the boxes build(buffers) returns over copies of `bufs` on `backend`; returns the
    buffers afterwards (CPU) and, for a verify pass, the boxes' digests."""
    if backend == "cuda":
        dev = {k: v.cuda() for k, v in bufs.items()}
        tbl = _C.DeviceBoxTable(table(build(dev)), 512)
        blob = torch.empty(max(tbl.nbytes, 1), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream()
        tbl.upload(blob.data_ptr(), stream.cuda_stream)
        tbl.launch(stream.cuda_stream)
        torch.cuda.synchronize()
        return {k: v.cpu() for k, v in dev.items()}, []
    out = {k: v.clone() for k, v in bufs.items()}
    boxes = table(build(out))
    digests: list = []
    if backend == "emulated":
        _C.DeviceBoxTable(boxes, 512).run_emulated()
    elif digest_pass:
        digests = list(_C.digest_boxes_cpu(boxes, digest_pass))
    else:
        _C.copy_boxes_cpu(boxes)
    return out, digests


def poison(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _case(dtype, scales, aligned):
    seed = zlib.crc32(f"{dtype}{scales}{aligned}".encode()) % 10007
    g = special_case((N, K), dtype, seed)
    _, grid = quantize_whole(g, scales)  # the global scales (what the amax reduction yields)
    mult = torch.empty(grid.numel(), dtype=torch.int32)
    codec.scales_from_amax(_global_amax(g, scales), scales, torch.empty(grid.numel()), mult)
    pad = 0 if aligned else 1
    piece = g[ROW0:ROW0 + ROWS]
    src = torch.cat([torch.zeros(pad, dtype=dtype), piece.reshape(-1)])
    ncb = -(-K // 128)
    rowmap = torch.from_numpy(((np.arange(ROWS) + ROW0) // 128 * ncb).astype(np.int32))
    colmap = torch.from_numpy((np.arange(K) // 128).astype(np.int32))
    return g, pad, {"src": src, "mult": mult, "rowmap": rowmap, "colmap": colmap}


def _global_amax(g: torch.Tensor, scales: str) -> torch.Tensor:
    from reshard_ext import Layout, Mesh, Replicate
    from reshard_ext.codecs.amax import AmaxPiece

    piece = AmaxPiece("g", Layout(tuple(g.shape), g.dtype, Mesh([0]), [Replicate()]), g, 0, (128, 128),
                      codec.NAN[scales])
    piece.partial()
    return piece.grid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("scales", ["fp32", "pow2"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8block_boxes(backend, dtype, scales, aligned):
    g, pad, bufs = _case(dtype, scales, aligned)
    off = 0 if aligned else 3
    bufs["out"] = poison(off + 67 * 384 + 10 * K + 10 * 128, 1)
    keep: list = []
    c = codec.codec(scales)
    es = g.element_size()

    def build(b):
        side = torch.tensor([b["mult"].data_ptr(), b["rowmap"].data_ptr(), b["colmap"].data_ptr()],
                            dtype=torch.int64).to(b["src"].device)
        keep.append(side)
        s, o = b["src"].data_ptr() + pad * es, b["out"].data_ptr() + off
        code = code_of(dtype)

        def box(first, shape, ss, dst_at, ds):
            return (s + first * es, o + dst_at, shape, ss, ds, code, E4M3 if first % 2 else U8, c, side.data_ptr(),
                    first, K)

        return [
            # piece rows 3..69, cols 16..399: across the global block rows 0/1 and block columns
            box(3 * K + 16, (67, 384), (K, 1), 0, (384, 1)),
            # whole rows 100..109 as one run (the planner merges contiguous rows)
            box(100 * K, (10 * K,), (1,), 67 * 384, (1,)),
            # 3-D: two groups of 5 rows 11 rows apart, cols 128..255
            box(120 * K + 128, (2, 5, 128), (11 * K, K, 1), 67 * 384 + 10 * K, (5 * 128, 128, 1)),
        ]

    got, _ = run(backend, build, bufs)
    want_data, _ = ref_fp8block(g, scales)
    piece = want_data[ROW0:ROW0 + ROWS]
    want = bufs["out"].clone()
    w = want[off:]
    w[:67 * 384] = piece[3:70, 16:400].reshape(-1)
    w[67 * 384:67 * 384 + 10 * K] = piece[100:110].reshape(-1)
    at = 67 * 384 + 10 * K
    w[at:at + 10 * 128] = torch.cat([piece[120:125, 128:256], piece[131:136, 128:256]]).reshape(-1)
    assert_bytes(got["out"], want, f"{backend} {dtype} {scales}")
    assert torch.equal(got["src"].view(torch.uint8), bufs["src"].view(torch.uint8)), "source written"


@pytest.mark.parametrize("scales", ["fp32", "pow2"])
def test_fp8block_box_digests(scales):
    """Verify passes: what the box writes (COPY), would write (SRC) and what its
    destination holds (DST) digest alike, as a plain copy of the E4M3 bytes does."""
    g, pad, bufs = _case(BF16, scales, True)
    bufs["out"] = torch.zeros(40 * K, dtype=torch.uint8)
    keep: list = []

    def build(b):
        side = torch.tensor([b["mult"].data_ptr(), b["rowmap"].data_ptr(), b["colmap"].data_ptr()], dtype=torch.int64)
        keep.append(side)
        return [(b["src"].data_ptr() + (50 * K + 32) * 2, b["out"].data_ptr(), (40, K - 64), (K, 1), (K - 64, 1),
                 code_of(BF16), U8, codec.codec(scales), side.data_ptr(), 50 * K + 32, K)]

    copied, d_copy = run("twin", build, bufs, int(_C.PASS_COPY))
    _, d_src = run("twin", build, bufs, int(_C.PASS_SRC))
    _, d_dst = run("twin", lambda b: build({**b, "out": copied["out"]}), bufs, int(_C.PASS_DST))
    plain = [(copied["out"].data_ptr(), copied["out"].data_ptr() + 1, (40 * (K - 64),), (1,), (1,), U8, U8)]
    scratch = torch.zeros(1, dtype=torch.uint8)
    d_plain = list(_C.digest_boxes_cpu(table([(plain[0][0], scratch.data_ptr(), *plain[0][2:])]), int(_C.PASS_SRC)))
    assert d_copy == d_src == d_dst == d_plain, (d_copy, d_src, d_dst, d_plain)
    assert d_copy[0] != 0


BF16_CODE = code_of(BF16)


def _bad(shape=(4, 64), ss=(448, 1), ds=(64, 1), sd=BF16_CODE, dd=U8, scales=0, side=4096, first=0, stride=448):
    return (8192, 16384, shape, ss, ds, sd, dd, int(_C.BOX_FP8B) | scales << 8, side, first, stride)


GOOD = {"bf16": _bad(), "fp32 source": _bad(sd=code_of(F32)), "e4m3 destination": _bad(dd=E4M3),
        "pow2": _bad(scales=1), "first on an item": _bad(first=3 * 448 + 16)}
BAD = {
    "no side record": _bad(side=0),
    "inner extent not whole items": _bad(shape=(4, 40)),
    "strided innermost": _bad(ss=(448, 2)),
    "fp16 source": _bad(sd=code_of(torch.float16)),
    "bf16 destination": _bad(dd=code_of(BF16)),
    "unknown scales": _bad(scales=2),
    "first off the items": _bad(first=8),
    "no row stride": _bad(stride=0),
    "negative first": _bad(first=-16),
}


@pytest.mark.parametrize("which", sorted(GOOD))
def test_good_fp8block_boxes_are_accepted(which):
    assert_box_plans(GOOD[which])


@pytest.mark.parametrize("why", sorted(BAD))
def test_bad_fp8block_boxes_are_rejected(why):
    assert_box_refused(BAD[why])
