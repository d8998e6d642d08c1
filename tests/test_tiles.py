"""Tile planning for the CUDA box copy (rx_plan_tiles), on the CPU in every build.

Every tile covers a contiguous range of its box's row-major elements (api.h, rx_tile);
the tests map each tile to that range and check that the ranges of a box partition it
exactly, that wide units are legal for every address they touch, and that one table
yields enough tiles to fill a GPU whatever its shape.
"""
from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from _boxes import FLOATS, MAX_DIMS, contiguous_strides, itemsize, table

from reshard_ext import _C
from reshard_ext.layout import code_of

DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.int32, torch.float32, torch.int64,
          torch.float64)


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def element_range(row, tile) -> tuple[int, int]:
    """The row-major elements of box `row` that tile covers (api.h semantics)."""
    src, dst, shape, ss, ds, sc, dc = row
    _, unit, s_size, d_size, begin, end = tile
    es = s_size
    if unit == 0 or unit == es:
        return begin, end
    k = unit // es
    if len(shape) > 1:
        return begin * k, end * k
    base = src - src % unit  # 1-D: items count from the unit-aligned address below src
    lo, hi = base + begin * unit - src, base + end * unit - src
    assert lo % es == 0 and hi % es == 0
    return lo // es, hi // es


def check_tiles(rows, tiles, tile_bytes: int) -> None:
    per_box = defaultdict(list)
    for t in tiles:
        box, unit, s_size, d_size, begin, end = t
        assert 0 <= box < len(rows) and begin < end, t
        src, dst, shape, ss, ds, sc, dc = rows[box]
        sd, dd = _C.dtype_size(sc), _C.dtype_size(dc)
        assert (s_size, d_size) == (sd, dd), t
        if sc != dc:
            assert unit == 0, t
            item = max(sd, dd)
        else:
            assert unit in (1, 2, 4, 8, 16) and unit >= sd, t
            item = unit
            if unit > sd:  # wide items: contiguous innermost dim, every address aligned
                assert ss[-1] == 1 and ds[-1] == 1, t
                if len(shape) > 1:
                    assert src % unit == 0 and dst % unit == 0 and shape[-1] * sd % unit == 0, t
                    assert all(s * sd % unit == 0 for s in ss[:-1]) and all(s * sd % unit == 0 for s in ds[:-1]), t
                else:
                    assert (src - dst) % unit == 0, t
        # about tile_bytes, rounded up to whole warp passes
        assert (end - begin) * item <= max(tile_bytes, item) + 32 * item, (t, tile_bytes)
        per_box[box].append(element_range(rows[box], t))
    for i, row in enumerate(rows):
        ranges = sorted(per_box.get(i, []))
        count = numel(row[2])
        if count == 0:
            assert not ranges, f"empty box {i} got tiles"
            continue
        pos = 0
        for lo, hi in ranges:  # exactly once: sorted ranges abut with no gap or overlap
            assert lo == pos and hi > lo, (i, row, ranges)
            pos = hi
        assert pos == count, (i, row, ranges)


def item_address(row, unit: int, k: int, side: int) -> int:
    """Byte address of item k of a same-dtype box on side 0 (src) or 1 (dst), as the
    kernel's general walk computes it (api.h, rx_tile)."""
    ptr, shape, strides, es = row[side], row[2], row[3 + side], _C.dtype_size(row[5])
    if len(shape) == 1:
        return ptr - ptr % unit + k * unit
    dims = list(shape[:-1]) + [shape[-1] * es // unit]
    addr = ptr
    for d in range(len(dims) - 1, -1, -1):
        k, digit = divmod(k, dims[d])
        addr += digit * (unit if d == len(dims) - 1 else strides[d] * es)
    return addr


def check_flat_geometry(rows, tiles) -> int:
    """Flat tiles (RX_TILE_FLAT) exactly where the box allows one, and their geometry
    addresses the same bytes as the box for the first, a middle and the last item.
    Returns how many tiles are flat."""
    flat = 0
    for t in tiles:
        box, unit, _, _, begin, end, flags, src, dst, row_items, src_pitch, dst_pitch = t
        row = rows[box]
        shape, ss, ds, sc, dc = row[2:]
        eligible = sc == dc and unit > 0 and ss[-1] == 1 and ds[-1] == 1 and len(shape) <= 2
        assert bool(flags & 1) == eligible, (t, row)
        if not eligible:
            continue
        flat += 1
        for k in {begin, (begin + end) // 2, end - 1}:
            q, r = divmod(k, row_items)
            assert src + q * src_pitch + r * unit == item_address(row, unit, k, 0), (t, row, k)
            assert dst + q * dst_pitch + r * unit == item_address(row, unit, k, 1), (t, row, k)
    return flat


def random_row(rng: random.Random, huge: bool):
    if rng.random() < 0.3:
        sd, dd = rng.choice(FLOATS), rng.choice(FLOATS)
    else:
        sd = dd = rng.choice(DTYPES)
    ses, des = itemsize(sd), itemsize(dd)
    nd = rng.randint(1, MAX_DIMS)
    lim = (1 << 34) if huge else 40
    shape = []
    for _ in range(nd):
        shape.append(rng.choice((1, 2, 3, 7, 8, 16, 64, rng.randint(1, 1000), rng.randint(1, lim))))
    if rng.random() < 0.05:
        shape[rng.randrange(nd)] = 0
    cap = (1 << 36) if huge else (1 << 20)  # bounds the tile list
    while numel(shape) > cap:
        shape[rng.randrange(nd)] //= 2
    def strides(es: int):
        if rng.random() < 0.5:
            st = list(contiguous_strides(shape))
        else:
            st = [rng.choice((1, 2, 8, 64, 4096, rng.randint(1, 10 ** 6))) for _ in range(nd)]
        if rng.random() < 0.7:
            st[-1] = 1
        return tuple(st)
    def addr(es: int) -> int:
        return (1 << 40) + rng.randrange(0, 1 << 20) * 16 + rng.choice((0, 0, 0, es, 8, 16 - es)) // es * es % 16
    return (addr(ses), addr(des), tuple(shape), strides(ses), strides(des), code_of(sd), code_of(dd))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tile_bytes", [0, 512, 4096, 65536])
def test_random_tables_are_covered_exactly_once(seed: int, tile_bytes: int) -> None:
    rng = random.Random(seed * 7919 + tile_bytes)
    rows = [random_row(rng, huge=False) for _ in range(300)]
    tiles = _C.plan_tiles(table(rows), tile_bytes)
    check_tiles(rows, tiles, tile_bytes if tile_bytes > 0 else 64 << 10)
    assert check_flat_geometry(rows, _C.plan_tiles(table(rows), tile_bytes, geometry=True)) > 0


@pytest.mark.parametrize("seed", range(4))
def test_huge_boxes_are_covered_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    rows = [random_row(rng, huge=True) for _ in range(8)]
    tile_bytes = 1 << 26  # keeps the tile list short for boxes of up to 2^40 elements
    tiles = _C.plan_tiles(table(rows), tile_bytes)
    check_tiles(rows, tiles, tile_bytes)
    check_flat_geometry(rows, _C.plan_tiles(table(rows), tile_bytes, geometry=True))


def test_refit_boxes_get_flat_tiles_and_others_do_not() -> None:
    """Column slices, staging regions and unaligned 1-D runs carry their own geometry
    (one descriptor fetch per warp); 3-D boxes, transposes and casts read their box."""
    bf16, f32 = code_of(torch.bfloat16), code_of(torch.float32)
    flat_rows = [((1 << 40) + 1024, 1 << 41, (4096, 512), (4096, 1), (512, 1), bf16, bf16),
                 ((1 << 40) + 6, (1 << 41) + 6, (100_003,), (1,), (1,), bf16, bf16)]
    other_rows = [(1 << 40, 1 << 41, (4, 64, 64), (8192, 128, 1), (4096, 64, 1), bf16, bf16),
                  (1 << 40, 1 << 41, (64, 64), (1, 64), (64, 1), f32, f32),
                  (1 << 40, 1 << 41, (1000, 33), (33, 1), (33, 1), f32, bf16)]
    tiles = _C.plan_tiles(table(flat_rows + other_rows), 4096, geometry=True)
    assert check_flat_geometry(flat_rows + other_rows, tiles) > 0
    assert {t[6] for t in tiles if t[0] < 2} == {1} and {t[6] for t in tiles if t[0] >= 2} == {0}


def test_one_huge_box_fills_the_gpu() -> None:
    n = 1 << 29  # 1 GiB of bf16
    rows = [(1 << 40, 1 << 41, (n,), (1,), (1,), code_of(torch.bfloat16), code_of(torch.bfloat16))]
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    assert len(tiles) >= 132 * 32  # at least a wave of warps on an H100
    assert {t[1] for t in tiles} == {16}


def test_ten_thousand_tiny_boxes_get_one_tile_each() -> None:
    bf16 = code_of(torch.bfloat16)
    rows = [((1 << 40) + 4096 * i, (1 << 41) + 64 * i, (4, 8), (1024, 1), (8, 1), bf16, bf16) for i in range(10_000)]
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    assert len(tiles) == 10_000 and {t[1] for t in tiles} == {16}


def test_empty_boxes_get_no_tiles() -> None:
    f32 = code_of(torch.float32)
    rows = [(1 << 40, 1 << 41, (0,), (1,), (1,), f32, f32),
            (1 << 40, 1 << 41, (5, 0, 3), (3, 3, 1), (0, 3, 1), f32, f32)]
    assert _C.plan_tiles(table(rows), 0) == []
    assert _C.plan_tiles(table([]), 0) == []


def test_column_slice_pack_uses_16_byte_items() -> None:
    # a TP column slice of a bf16 [4096, 4096] weight into 16-byte aligned staging
    bf16 = code_of(torch.bfloat16)
    rows = [((1 << 40) + 512 * 2, 1 << 41, (4096, 512), (4096, 1), (512, 1), bf16, bf16)]
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    assert {t[1] for t in tiles} == {16}


def test_unaligned_contiguous_box_gets_head_body_tail() -> None:
    bf16 = code_of(torch.bfloat16)
    rows = [((1 << 40) + 6, (1 << 41) + 6, (100_003,), (1,), (1,), bf16, bf16)]
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    units = [t[1] for t in tiles]
    assert units[0] == 2 and units[-1] == 2 and set(units[1:-1]) == {16}
    # relatively misaligned by 8 bytes: 8-byte items
    rows = [((1 << 40) + 8, 1 << 41, (100_000,), (1,), (1,), bf16, bf16)]
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    assert {t[1] for t in tiles} == {8}


def test_strided_innermost_dim_uses_element_items() -> None:
    f32 = code_of(torch.float32)
    rows = [(1 << 40, 1 << 41, (64, 64), (1, 64), (64, 1), f32, f32)]  # a transpose
    tiles = _C.plan_tiles(table(rows), 0)
    check_tiles(rows, tiles, 64 << 10)
    assert {t[1] for t in tiles} == {4}


def test_cast_tiles_are_element_items() -> None:
    rows = [(1 << 40, 1 << 41, (1000, 33), (33, 1), (33, 1), code_of(torch.float32), code_of(torch.bfloat16))]
    tiles = _C.plan_tiles(table(rows), 4096)
    check_tiles(rows, tiles, 4096)
    assert {(t[1], t[2], t[3]) for t in tiles} == {(0, 4, 2)}


@pytest.mark.parametrize("bad", [
    dict(ndim=0), dict(ndim=MAX_DIMS + 1), dict(cast=(torch.int32, torch.float32)),
    dict(src=(1 << 40) + 2), dict(shape=-1),
])
def test_bad_boxes_are_rejected(bad: dict) -> None:
    sd, dd = bad.get("cast", (torch.float32, torch.float32))
    nd = bad.get("ndim", 1)
    shape = (bad.get("shape", 8),) * nd
    row = (bad.get("src", 1 << 40), 1 << 41, shape, (1,) * nd, (1,) * nd, code_of(sd), code_of(dd))
    if nd > MAX_DIMS:
        import numpy as np
        from _boxes import BOX
        a = np.frombuffer(bytearray(table([row[:2] + ((8,),) + ((1,),) * 2 + row[5:]])), dtype=BOX).copy()
        a[0]["ndim"] = nd
        blob = a.tobytes()
    else:
        blob = table([row])
    with pytest.raises(RuntimeError):
        _C.plan_tiles(blob, 0)


def test_the_checker_catches_gaps_overlaps_and_bad_units() -> None:
    bf16 = code_of(torch.bfloat16)
    rows = [((1 << 40) + 2, 1 << 41, (64, 100), (128, 1), (100, 1), bf16, bf16)]
    tiles = _C.plan_tiles(table(rows), 1024)
    check_tiles(rows, tiles, 1024)
    box, unit, ss, ds, b, e = tiles[1]
    for broken in (tiles[:1] + tiles[2:],  # a gap
                   tiles + [tiles[1]],  # an overlap
                   tiles[:1] + [(box, unit, ss, ds, b, e - 1)] + tiles[2:],  # a short tile
                   [(t[0], 8) + t[2:] for t in tiles]):  # 8-byte items on a 2-byte-aligned box
        with pytest.raises(AssertionError):
            check_tiles(rows, broken, 1024)
