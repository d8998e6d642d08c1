"""MXFP8 fused into the box kernels (rx_box modes MX_DATA and MX_SCALE) against the
reference quantizer of test_mxfp8_kernels, on three backends that must agree:
  twin:     the CPU twin (copy_boxes_cpu), the data path of the gloo refit;
  emulated: the CUDA kernel's own per-lane code run on the host (any CUDA build);
  cuda:     the real kernel on a GPU (skipped without one).
Every output buffer is poisoned first and compared whole, so bytes outside the boxes
must stay untouched, and every box is checked against quantizing its BF16 window.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch
from _boxes import assert_box_plans, assert_box_refused, table
from test_mxfp8_kernels import CASES, ROUNDINGS, assert_bytes_equal, make_case, ref_mxfp8, ref_swizzle

from reshard_ext import _C
from reshard_ext.layout import code_of
from reshard_ext.mxfp8 import swizzled_size

HAVE_KERNEL = hasattr(_C, "DeviceBoxTable")
HAVE_GPU = HAVE_KERNEL and torch.cuda.is_available()
BACKENDS = [
    "twin",
    pytest.param("emulated", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]),
]
BF16, U8, E4M3 = code_of(torch.bfloat16), code_of(torch.uint8), code_of(torch.float8_e4m3fn)
ROUND = {"ceil": int(_C.MX_ROUND_CEIL), "floor": int(_C.MX_ROUND_FLOOR)}
SCALES = {"2d": int(_C.MX_SCALE_2D), "swizzled": int(_C.MX_SCALE_SWIZZLED)}


def mode(kind: int, rounding: str, layout: str = "2d") -> int:
    return kind | ROUND[rounding] << 8 | SCALES[layout] << 16


def run(backend: str, build: Callable[[dict], list], bufs: dict[str, torch.Tensor], tile_bytes: int = 0) -> dict:
    """Runs the boxes `build(buffers)` returns over copies of `bufs` (CPU tensors) on
    `backend`; returns the buffers afterwards, on the CPU."""
    if backend == "cuda":
        dev = {k: v.cuda() for k, v in bufs.items()}
        tbl = _C.DeviceBoxTable(table(build(dev)), tile_bytes)
        blob = torch.empty(max(tbl.nbytes, 1), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream()
        tbl.upload(blob.data_ptr(), stream.cuda_stream)
        tbl.launch(stream.cuda_stream)
        torch.cuda.synchronize()
        return {k: v.cpu() for k, v in dev.items()}
    out = {k: v.clone() for k, v in bufs.items()}
    if backend == "emulated":
        _C.DeviceBoxTable(table(build(out)), tile_bytes).run_emulated()
    else:
        _C.copy_boxes_cpu(table(build(out)))
    return out


def poison(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def addr(t: torch.Tensor, offset_elems: int) -> int:
    return t.data_ptr() + offset_elems * t.element_size()


def scale_positions(rows: int, scols: int, layout: str) -> torch.Tensor:
    """[rows, scols]: the byte of each scale in a 2-D or swizzled buffer (the swizzled
    one from the reference ref_swizzle, not from the code under test)."""
    flat = torch.arange(rows * scols, dtype=torch.int64)
    if layout == "2d":
        return flat.view(rows, scols)
    at = ref_swizzle(flat.view(rows, scols) + 1)    # 2-D index + 1 at each byte, 0 in the padding
    pos = torch.empty(rows * scols, dtype=torch.int64)
    where = at.nonzero().view(-1)
    pos[at[where] - 1] = where
    return pos.view(rows, scols)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("layout", ["2d", "swizzled"])
def test_mx_data_boxes(backend, rounding, case, aligned, layout):
    """Receiver-style boxes (BF16 window -> window of a contiguous [md, kd] E4M3 buffer,
    each block's scale placed in its 2-D [md, kd/32] or swizzled scale buffer) and a
    sender-style pack box (data only, aux 0) in one table. The swizzled buffer has two
    row tiles and two column tiles; boxes cross both tile boundaries, and one 1-D box
    runs over whole data rows (its blocks' rows come from dividing by K). Every byte
    outside the boxes, the swizzled padding included, keeps its poison. misaligned: rows
    and buffers off the 16-byte grid, so the 2-byte loads and byte stores run too."""
    seed = zlib.crc32(f"{case}{rounding}{aligned}{layout}".encode()) % 10007
    src = make_case(case, rows=40, cols=352, seed=seed)       # the parent BF16 tensor
    pad = 0 if aligned else 1                                 # misaligned: odd element offsets
    src_buf = torch.cat([torch.zeros(pad, dtype=torch.bfloat16), src.reshape(-1)])
    kd, md = 256, 140                                         # dst [md, kd] data, [md, kd/32] scales
    scols = kd // 32
    nscale = md * scols if layout == "2d" else swizzled_size(md, scols)
    off = 0 if aligned else 3                                 # dst buffers off the 16-byte grid
    bufs = {"src": src_buf, "data": poison(off + md * kd, seed), "scale": poison(off + nscale, seed + 1),
            "pack": poison(16 + 5 * 64 + 7 * 96, seed + 2)}
    # Blocks are the box's: its src columns need not sit on the src's 32-grid.
    c2, c3 = (8, 0) if aligned else (7, 3)
    m = mode(_C.BOX_MX_DATA, rounding, layout)

    def build(b):
        s, d, sc, pk = b["src"], b["data"], b["scale"], b["pack"]

        def data_box(src_at, first, shape, ss, ds):  # dst: data elements from `first` on
            return (addr(s, pad + src_at), addr(d, off + first), shape, ss, ds, BF16, E4M3, m, addr(sc, off), first, kd)

        return [
            # src rows 9..18, cols c2..c2+127 -> data[3:13, 64:192] (scale cols 2..5)
            data_box(9 * 352 + c2, 3 * kd + 64, (10, 128), (352, 1), (kd, 1)),
            # 3-D: src rows 2..6 and 13..17, cols c3..c3+63 -> data[13:23, 160:224]
            data_box(2 * 352 + c3, 13 * kd + 160, (2, 5, 64), (11 * 352, 352, 1), (5 * kd, kd, 1)),
            # 1-D over whole rows: 10 * 256 src elements from row 20 -> data[122:132, :]
            data_box(20 * 352, 122 * kd, (10 * kd,), (1,), (1,)),
            # rows 24..31, cols 96..159 -> data[132:140, 96:160] (scale cols 3, 4: two column tiles)
            data_box(24 * 352 + 96, 132 * kd + 96, (8, 64), (352, 1), (kd, 1)),
            # pack: rows 30..36, cols 96..191 into contiguous staging, no scale output
            (addr(s, pad + 30 * 352 + 96), addr(pk, 16 + (0 if aligned else 5)), (7, 96), (352, 1), (96, 1),
             BF16, U8, mode(_C.BOX_MX_DATA, rounding), 0),
        ]

    got = run(backend, build, bufs, tile_bytes=512)
    want = {k: v.clone() for k, v in bufs.items()}
    data = want["data"][off:].view(md, kd)
    scale = torch.full((md, scols), -1, dtype=torch.int16)  # -1: not written
    d, s = ref_mxfp8(src[9:19, c2:c2 + 128].contiguous(), rounding)
    data[3:13, 64:192], scale[3:13, 2:6] = d, s
    for g in range(2):
        d, s = ref_mxfp8(src[2 + 11 * g:7 + 11 * g, c3:c3 + 64].contiguous(), rounding)
        data[13 + 5 * g:18 + 5 * g, 160:224], scale[13 + 5 * g:18 + 5 * g, 5:7] = d, s
    d, s = ref_mxfp8(src.reshape(-1)[20 * 352:20 * 352 + 10 * kd].view(10, kd), rounding)
    data[122:132], scale[122:132] = d, s
    d, s = ref_mxfp8(src[24:32, 96:160].contiguous(), rounding)
    data[132:140, 96:160], scale[132:140, 3:5] = d, s
    written = scale >= 0
    want["scale"][off + scale_positions(md, scols, layout)[written]] = scale[written].to(torch.uint8)
    d, _ = ref_mxfp8(src[30:37, 96:192].contiguous(), rounding)
    p0 = 16 + (0 if aligned else 5)
    want["pack"][p0:p0 + 7 * 96] = d.reshape(-1)
    for k in ("data", "scale", "pack"):
        assert_bytes_equal(got[k], want[k], f"{backend} {k}")
    assert torch.equal(got["src"].view(torch.int16), bufs["src"].view(torch.int16)), "source written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("case", ["wide", "bits", "zeros", "boundary"])
def test_mx_scale_boxes(backend, rounding, case):
    """Sender-style scale boxes: a BF16 window read in scale coordinates (innermost src
    stride 32) into contiguous staging and into a transposed strided window."""
    seed = zlib.crc32(f"scale{case}{rounding}".encode()) % 10007
    src = make_case(case, rows=33, cols=320, seed=seed)
    bufs = {"src": src.reshape(-1).clone(), "pack": poison(2048, seed), "t": poison(10 * 40, seed + 1)}

    def build(b):
        s = b["src"]
        return [
            # rows 1..30, blocks 2..9 (cols 64..319) -> contiguous staging at byte 5
            (addr(s, 1 * 320 + 64), b["pack"].data_ptr() + 5, (30, 8), (320, 32), (8, 1), BF16, U8,
             mode(_C.BOX_MX_SCALE, rounding), 0),
            # rows 0..32, blocks 0..9 -> t[block, row] of a [10, 40] buffer (column-major window)
            (addr(s, 0), b["t"].data_ptr(), (33, 10), (320, 32), (1, 40), BF16, U8, mode(_C.BOX_MX_SCALE, rounding), 0),
        ]

    got = run(backend, build, bufs, tile_bytes=256)
    _, s_all = ref_mxfp8(src, rounding)                       # [33, 10]
    want_pack, want_t = bufs["pack"].clone(), bufs["t"].clone().view(10, 40)
    want_pack[5:5 + 240] = s_all[1:31, 2:10].reshape(-1)
    want_t[:, :33] = s_all.t()
    assert_bytes_equal(got["pack"], want_pack, f"{backend} pack")
    assert_bytes_equal(got["t"], want_t, f"{backend} transposed")


def _box(shape, ss, ds, sd, dd, kind, rounding=0, aux=0, scales=0, first=0, cols=None):
    """A box at fake addresses (never run); with aux, a row length of 64 by default."""
    cols = (64 if aux else 0) if cols is None else cols
    return (4096, 8192, shape, ss, ds, sd, dd, kind | rounding << 8 | scales << 16, aux, first, cols)


SWZ = int(_C.MX_SCALE_SWIZZLED)
# Boxes that differ from a bad one only in the named field: each must be accepted.
GOOD = {
    "data": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1),
    "data with 2-D scales": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, aux=1 << 20, first=128),
    "data with swizzled scales": _box((4, 64), (64, 1), (128, 1), BF16, E4M3, 1, aux=1 << 20, scales=SWZ,
                                      first=96, cols=128),
    "scales": _box((4, 2), (64, 32), (2, 1), BF16, U8, 2),
}
BAD = {
    "inner extent not whole blocks": _box((4, 48), (64, 1), (64, 1), BF16, E4M3, 1),
    "strided innermost": _box((4, 64), (128, 2), (64, 1), BF16, E4M3, 1),
    "fp32 source": _box((4, 64), (64, 1), (64, 1), code_of(torch.float32), E4M3, 1),
    "bf16 destination": _box((4, 64), (64, 1), (64, 1), BF16, BF16, 1),
    "scale rows not whole blocks": _box((4, 64), (64, 1), (48, 1), BF16, E4M3, 1, aux=1 << 20),
    "unknown rounding": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, rounding=2),
    "unknown kind": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 3),
    "aux on a scale box": _box((4, 2), (64, 32), (2, 1), BF16, U8, 2, aux=1 << 20),
    "aux on a copy": _box((4, 64), (64, 1), (64, 1), BF16, BF16, 0, aux=1 << 20),
    "unknown scale layout": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, aux=1 << 20, scales=2),
    "scale layout without scales": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, scales=SWZ),
    "scale layout on a scale box": _box((4, 2), (64, 32), (2, 1), BF16, U8, 2, scales=SWZ),
    "scale layout on a copy": _box((4, 64), (64, 1), (64, 1), BF16, BF16, 0, scales=SWZ),
    "row length not whole blocks": _box((4, 64), (64, 1), (128, 1), BF16, E4M3, 1, aux=1 << 20, scales=SWZ,
                                        cols=80),
    "no row length": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, aux=1 << 20, scales=SWZ, cols=0),
    "first element off the block grid": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, aux=1 << 20, first=16),
    "negative first element": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, aux=1 << 20, first=-32),
    "row length without scales": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, cols=64),
    "first element without scales": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1, first=32),
    "row length on a copy": _box((4, 64), (64, 1), (64, 1), BF16, BF16, 0, cols=64),
    "high mode bits": _box((4, 64), (64, 1), (64, 1), BF16, E4M3, 1 | 1 << 24),
}


@pytest.mark.parametrize("which", sorted(GOOD))
def test_good_mx_boxes_are_accepted(which):
    assert_box_plans(GOOD[which])


@pytest.mark.parametrize("why", sorted(BAD))
def test_bad_mx_boxes_are_rejected(why):
    assert_box_refused(BAD[why])


def test_mx_tiles_cover_whole_blocks():
    """Tiles of an MX_DATA box count blocks, of an MX_SCALE box scale bytes; together
    they cover each box once, in order."""
    boxes = [_box((7, 96), (352, 1), (96, 1), BF16, U8, 1), _box((30, 8), (320, 32), (8, 1), BF16, U8, 2),
             _box((0, 64), (64, 1), (64, 1), BF16, E4M3, 1)]
    tiles = _C.plan_tiles(table(boxes), 512)
    for i, items in enumerate((7 * 96 // 32, 30 * 8, 0)):
        mine = [(b, e) for box, unit, ss, ds, b, e in tiles if box == i]
        assert all(unit == 0 for box, unit, *_ in tiles if box == i)
        assert sum(e - b for b, e in mine) == items
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
