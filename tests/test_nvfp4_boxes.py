"""NVFP4 fused into the box kernels (rx_box codecs NV_DATA and NV_SCALE: a sender's pack or
same-rank copy that quantizes BF16 pairs, read as int32 words, under the tensor's amax)
against the codec's whole-piece quantize (itself checked against torchao in
test_nvfp4_kernels), on three backends that must agree:
  twin:     the CPU twin (copy_boxes_cpu);
  emulated: the CUDA kernel's own per-lane code run on the host (any CUDA build);
  cuda:     the real kernel on a GPU (skipped without one).
Every output buffer is poisoned first and compared whole, so bytes outside the boxes
must stay untouched; the verify passes digest exactly the bytes a box writes.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch
from _boxes import assert_box_plans, assert_box_refused, table
from _nvfp4_ref import make_case

from reshard_ext import _C
from reshard_ext.codecs import nvfp4 as nv
from reshard_ext.layout import code_of

HAVE_KERNEL = hasattr(_C, "DeviceBoxTable")
HAVE_GPU = HAVE_KERNEL and torch.cuda.is_available()
BACKENDS = [
    "twin",
    pytest.param("emulated", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]),
]
I32, U8, E4M3, BF16 = (code_of(d) for d in (torch.int32, torch.uint8, torch.float8_e4m3fn, torch.bfloat16))
DATA, SCALE = int(_C.BOX_NV_DATA), int(_C.BOX_NV_SCALE)
PASSES = {"copy": int(_C.PASS_COPY), "src": int(_C.PASS_SRC), "dst": int(_C.PASS_DST)}


def run(backend: str, build: Callable[[dict], list], bufs: dict[str, torch.Tensor], pass_: str | None = None,
        tile_bytes: int = 512) -> tuple[dict, list[int]]:
    """Runs the boxes `build(buffers)` returns over copies of the CPU `bufs` on `backend`
    (a verify pass when given); returns the buffers afterwards and the box digests."""
    p = PASSES[pass_] if pass_ else None
    if backend == "cuda":
        import numpy as np

        dev = {k: v.cuda() for k, v in bufs.items()}
        tbl = _C.DeviceBoxTable(table(build(dev)), tile_bytes)
        blob = torch.empty(max(tbl.nbytes, 1), dtype=torch.uint8, device="cuda")
        out = torch.zeros(max(tbl.num_boxes, 1), dtype=torch.int64, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        tbl.upload(blob.data_ptr(), stream)
        if p is None:
            tbl.launch(stream)
        else:
            tbl.launch(stream, 0, out.data_ptr(), p, -1)
        torch.cuda.synchronize()
        return {k: v.cpu() for k, v in dev.items()}, [int(x) for x in out.cpu().numpy().view(np.uint64)]
    out_bufs = {k: v.clone() for k, v in bufs.items()}
    tbl = table(build(out_bufs))
    if backend == "emulated":
        dg = _C.DeviceBoxTable(tbl, tile_bytes).run_emulated(*(() if p is None else (p,)))
    else:
        dg = _C.copy_boxes_cpu(tbl) if p is None else _C.digest_boxes_cpu(tbl, p)
    return out_bufs, list(dg or [])


def poison(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def quantized(x: torch.Tensor, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-piece quantize of BF16 x [..., K] under the amax in `cell`: (data, 2-D scales)."""
    x = x.contiguous()
    rows = x.numel() // x.shape[-1]
    data = torch.empty(rows, x.shape[-1] // 2, dtype=torch.uint8)
    scale = torch.empty(rows, x.shape[-1] // 16, dtype=torch.uint8)
    nv.quantize(x, cell, data, scale, None)
    return data, scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["normal", "wide", "bits", "zero_blocks", "inf", "nan", "all_zero"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_data_and_scale_boxes(backend, kind, aligned):
    """Pack-style boxes of one table over a [40, 352] BF16 source (176 words a row) under
    the whole source's amax: 2-D and 3-D windows whose blocks are the box's (a window may
    start off the source's 16-grid), a 1-D box over whole rows, scale boxes into staging and
    into a transposed window. misaligned: the source off the 16-byte grid (word loads) and
    the outputs off the 8-byte grid (byte stores)."""
    seed = zlib.crc32(f"{kind}{aligned}".encode()) % 10007
    src = make_case(kind, (40, 352), seed)
    pad = 0 if aligned else 2  # in BF16 elements: 4 bytes, words stay words
    words = torch.cat([torch.zeros(pad, dtype=torch.bfloat16), src.reshape(-1)]).view(torch.int32)
    cell = src.abs().max().float().view(torch.int32).view(1).clone()  # the tensor's amax, as the pre-pass gives it
    off = 0 if aligned else 3
    bufs = {"w": words, "cell": cell, "d": poison(off + 2048, seed), "t": poison(off + 22 * 40, seed + 1),
            "s": poison(off + 256, seed + 2)}
    c2 = 4 if aligned else 3  # a window starting at pair 4 (element 8) or 3 (element 6)

    def build(b):
        w0, d0 = b["w"].data_ptr() + 2 * pad, b["d"].data_ptr() + off
        amax = b["cell"].data_ptr()

        def box(src_word, dst_byte, shape, ss, ds, kind_, dst=None, dd=U8):
            return (w0 + 4 * src_word, (dst if dst is not None else d0) + dst_byte, shape, ss, ds, I32, dd, kind_,
                    amax)

        return [
            box(9 * 176 + c2, 0, (10, 64), (176, 1), (64, 1), DATA),               # rows 9..18, 64 words -> d[0:640]
            box(2 * 176 + 40, 640, (2, 5, 16), (11 * 176, 176, 1), (80, 16, 1), DATA),  # rows 2..6, 13..17
            box(20 * 176, 800, (2 * 176,), (1,), (1,), DATA),                     # rows 20, 21 whole
            box(30 * 176, 0, (10, 22), (176, 8), (1, 40), SCALE, b["t"].data_ptr() + off),  # t[block, row - 30]
            box(1 * 176 + 8, 0, (12, 20), (176, 8), (20, 1), SCALE, b["s"].data_ptr() + off, E4M3),  # staging
        ]

    got, _ = run(backend, build, bufs)
    want = {k: v.clone() for k, v in bufs.items()}
    d = want["d"][off:]
    w = words.view(torch.bfloat16)[pad:].view(40, 352)
    e = 2 * c2
    d[0:640] = quantized(w[9:19, e:e + 128], cell)[0].reshape(-1)
    for g in range(2):
        d[640 + 80 * g:720 + 80 * g] = quantized(w[2 + 11 * g:7 + 11 * g, 80:112], cell)[0].reshape(-1)
    d[800:800 + 352] = quantized(w[20:22], cell)[0].reshape(-1)
    _, s_all = quantized(w, cell)  # [40, 22]
    want["t"][off:off + 22 * 40].view(22, 40)[:, :10] = s_all[30:40].t()
    want["s"][off:off + 240] = s_all[1:13, 1:21].reshape(-1)
    for k in ("d", "t", "s"):
        assert torch.equal(got[k], want[k]), f"{backend} {k}: {(got[k] != want[k]).nonzero()[:4].view(-1).tolist()}"
    assert torch.equal(got["w"], bufs["w"]) and torch.equal(got["cell"], cell), "an input was written"

    # verify passes: each box's digest is that of the bytes it writes, as a plain byte copy
    # of those bytes digests them (what the receiver holds); copy, src and dst agree
    def plain(b):
        boxes = build(b)
        return [(r[1], r[1], r[2], r[4], r[4], r[6], r[6]) for r in boxes]  # dst onto itself

    _, copy = run(backend, build, bufs, "copy")
    _, src_pass = run(backend, build, bufs, "src")
    _, dst_pass = run(backend, build, got, "dst")
    _, bytes_ = run("twin", plain, got, "src")
    assert copy == src_pass == dst_pass == bytes_, backend


# Boxes at fake addresses (never run): (src, dst, shape, ss, ds, src dtype, dst dtype, codec, amax, p1, p2)
def _box(shape, ss, ds, sd, dd, codec, amax=1 << 20, p1=0, p2=0):
    return (4096, 8192, shape, ss, ds, sd, dd, codec, amax, p1, p2)


GOOD = {
    "data": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA),
    "data with its first element": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA, p1=16),  # exec tables set it
    "scales": _box((4, 8), (64, 8), (8, 1), I32, U8, SCALE),
    "e4m3 scales": _box((4, 8), (64, 8), (8, 1), I32, E4M3, SCALE),
}
BAD = {
    "inner extent not whole blocks": _box((4, 60), (64, 1), (64, 1), I32, U8, DATA),
    "strided innermost": _box((4, 64), (128, 2), (64, 1), I32, U8, DATA),
    "bf16 words": _box((4, 64), (64, 1), (64, 1), BF16, U8, DATA),
    "e4m3 data": _box((4, 64), (64, 1), (64, 1), I32, E4M3, DATA),
    "no amax cell": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA, amax=0),
    "a second param": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA, p2=64),
    "a negative first element": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA, p1=-8),
    "flags": _box((4, 64), (64, 1), (64, 1), I32, U8, DATA | 1 << 8),
    "bf16 scales": _box((4, 8), (64, 8), (8, 1), I32, BF16, SCALE),
}


@pytest.mark.parametrize("which", sorted(GOOD))
def test_good_boxes_are_accepted(which):
    assert_box_plans(GOOD[which])


@pytest.mark.parametrize("why", sorted(BAD))
def test_bad_boxes_are_rejected(why):
    assert_box_refused(BAD[why])


def test_tiles_cover_whole_blocks():
    """Tiles of a data box count blocks (8 words), of a scale box scale bytes."""
    boxes = [_box((7, 96), (176, 1), (96, 1), I32, U8, DATA), _box((30, 8), (176, 8), (8, 1), I32, U8, SCALE)]
    tiles = _C.plan_tiles(table(boxes), 256)
    for i, items in enumerate((7 * 96 // 8, 30 * 8)):
        mine = [(b, e) for box, unit, ss, ds, b, e in tiles if box == i]
        assert sum(e - b for b, e in mine) == items
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))


def test_codec_records():
    """The codec table's NVFP4 records: a data box's item is a block (8 words in, 32 source
    bytes), cut on whole blocks; a scale box's item is one scale byte; no receiver digest."""
    from reshard_ext import codecs

    data, scales = codecs.traits("nvfp4"), codecs.traits("nvfp4_scales")
    assert (data.id, scales.id) == (DATA, SCALE)
    assert (data.grain, data.item_elems, data.item_bytes, data.digest) == (8, 8, 32, False)
    assert (scales.grain, scales.item_elems, scales.item_bytes, scales.digest) == (1, 1, 32, False)
