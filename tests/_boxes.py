"""rx_box tables from Python (tests and benchmarks).

`BOX` mirrors `struct rx_box` of csrc/core/box.h. A `Spec` is one box relative to
two byte buffers (src, dst), so the same boxes can be realised over GPU memory, CPU
memory and the CPU twin's copies of it.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from reshard_ext import _C
from reshard_ext.layout import code_of

MAX_DIMS = int(_C.MAX_DIMS)
BOX = np.dtype([
    ("src", "<u8"), ("dst", "<u8"),
    ("shape", "<i8", (MAX_DIMS,)), ("src_stride", "<i8", (MAX_DIMS,)), ("dst_stride", "<i8", (MAX_DIMS,)),
    ("ndim", "<i4"), ("src_dtype", "<i4"), ("dst_dtype", "<i4"), ("codec", "<i4"), ("param", "<i8", (3,)),
    ("digest", "<i4"), ("reserved", "<i4"),
])
assert BOX.itemsize == _C.BOX_BYTES, (BOX.itemsize, _C.BOX_BYTES)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# One dtype per element size, plus the float types (casts and bit copies).
COPY_DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.int32, torch.float32,
               torch.int64, torch.float64)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def table(rows: Sequence[tuple]) -> bytes:
    """rows: (src, dst, shape, src_stride, dst_stride, src_code, dst_code[, codec, param0[, param1, param2]])
    (MXFP8: codec id | rounding << 8 | scales << 16; params: scale buffer, first element, row length)."""
    a = np.zeros(len(rows), dtype=BOX)
    for i, (src, dst, shape, ss, ds, sc, dc, *codec) in enumerate(rows):
        n = len(shape)
        a[i]["src"], a[i]["dst"], a[i]["ndim"] = src, dst, n
        a[i]["shape"][:n], a[i]["src_stride"][:n], a[i]["dst_stride"][:n] = shape, ss, ds
        a[i]["src_dtype"], a[i]["dst_dtype"] = sc, dc
        if codec:
            a[i]["codec"] = codec[0]
            a[i]["param"][:len(codec) - 1] = codec[1:]
    return a.tobytes()


def fold(shape: Sequence[int], ss: Sequence[int], ds: Sequence[int]):
    """Drops size-1 dims and merges dims contiguous on both sides, as the planner's
    make_box does, so tests also hit the 1-D and 2-D kernel paths."""
    dims: list[list[int]] = []
    for n, s, d in reversed(list(zip(shape, ss, ds))):
        if n == 1:
            continue
        if dims and s == dims[-1][0] * dims[-1][1] and d == dims[-1][0] * dims[-1][2]:
            dims[-1][0] *= n
            continue
        dims.append([n, s, d])
    if not dims:
        dims = [[1, 1, 1]]
    dims.reverse()
    return tuple(x[0] for x in dims), tuple(x[1] for x in dims), tuple(x[2] for x in dims)


@dataclass
class Spec:
    shape: tuple
    src_off: int  # bytes into the src buffer
    src_stride: tuple  # elements
    src_dtype: torch.dtype
    dst_off: int
    dst_stride: tuple
    dst_dtype: torch.dtype

    def row(self, src_base: int, dst_base: int) -> tuple:
        return (src_base + self.src_off, dst_base + self.dst_off, self.shape, self.src_stride, self.dst_stride,
                code_of(self.src_dtype), code_of(self.dst_dtype))


def specs_table(specs: Sequence[Spec], src: torch.Tensor, dst: torch.Tensor) -> bytes:
    return table([s.row(src.data_ptr(), dst.data_ptr()) for s in specs])


def view(buf: torch.Tensor, off: int, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A strided view of a uint8 buffer (length a multiple of 8) at byte offset `off`."""
    es = itemsize(dtype)
    assert off % es == 0
    return buf.view(dtype).as_strided(tuple(shape), tuple(stride), off // es)


def contiguous_strides(shape: Sequence[int]) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


class Arena:
    """Hands out disjoint byte ranges (dst boxes must not overlap each other)."""

    def __init__(self) -> None:
        self.size = 0

    def take(self, nbytes: int, align: int, misalign: int = 0) -> int:
        off = (self.size + align - 1) // align * align + misalign
        self.size = off + nbytes
        return off

    def nbytes(self) -> int:
        return (self.size + 255) // 256 * 256


def _window(rng: random.Random, arena: Arena, shape: tuple, es: int, align: int, misalign: int):
    """A box `shape` inside a random parent tensor with a random dim order: (off, strides)."""
    nd = len(shape)
    parent = [n + (rng.choice((0, 0, 1, 3)) if n else 0) for n in shape]
    order = list(range(nd))
    if rng.random() < 0.5:
        rng.shuffle(order)  # memory order of the parent's dims, innermost last
    strides = [0] * nd
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(parent[d], 1)
    base = arena.take(acc * es, align, misalign)
    start = [rng.randint(0, p - n) for p, n in zip(parent, shape)]
    return base + sum(s * st for s, st in zip(start, strides)) * es, tuple(strides)


def random_spec(rng: random.Random, src: Arena, dst: Arena, max_elems: int, casts: bool, copies: bool = True,
                dtypes: Sequence[torch.dtype] = COPY_DTYPES, fold_prob: float = 0.5) -> Spec:
    if casts and (not copies or rng.random() < 0.5):
        sd, dd = rng.choice(FLOATS), rng.choice(FLOATS)
    else:
        sd = dd = rng.choice(dtypes)
    ses, des = itemsize(sd), itemsize(dd)
    nd = rng.choice((1, 1, 2, 2, 2, 3, 4, MAX_DIMS))
    shape = []
    budget = max_elems
    for _ in range(nd):
        n = rng.randint(1, max(1, int(round(budget ** (1.0 / (nd - len(shape)))))))
        shape.append(n)
        budget = max(1, budget // n)
    if rng.random() < 0.03:
        shape[rng.randrange(nd)] = 0  # an empty box: no tiles, nothing written
    shape = tuple(shape)
    # Alignment: mostly the planner's (16-byte staging, aligned tensor slices), sometimes
    # only element-aligned, so every unit width and head/tail split is exercised.
    def misalign(es: int) -> int:
        return rng.choice((0, 0, 0, es, 8, 16 - es)) // es * es if es < 16 else 0

    s_off, s_str = _window(rng, src, shape, ses, 16, misalign(ses))
    if rng.random() < 0.5:  # pack: a contiguous staging region
        d_str = contiguous_strides(shape)
        d_off = dst.take(int(np.prod(shape)) * des, 16, misalign(des))
    else:  # unpack / copy: a strided window of a tensor
        d_off, d_str = _window(rng, dst, shape, des, 16, misalign(des))
    if rng.random() < fold_prob and all(shape):
        shape, s_str, d_str = fold(shape, s_str, d_str)
    return Spec(shape, s_off, s_str, sd, d_off, d_str, dd)


def random_specs(seed: int, count: int, max_elems: int, casts: bool, copies: bool = True,
                 big: int | None = None) -> tuple[list[Spec], int, int]:
    """`count` random boxes (plus, with `big`, one contiguous 1-D box of `big` bytes with
    equally misaligned ends); returns (specs, src_bytes, dst_bytes)."""
    rng = random.Random(seed)
    src, dst = Arena(), Arena()
    specs = [random_spec(rng, src, dst, max_elems, casts, copies) for _ in range(count)]
    if big:
        n = big // 2
        mis = 6
        specs.append(Spec((n,), src.take(2 * n, 16, mis), (1,), torch.bfloat16,
                          dst.take(2 * n, 16, mis), (1,), torch.bfloat16))
    return specs, src.nbytes(), dst.nbytes()


def nan_free_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes whose every 2/4/8-byte float view is finite (bit 6 of each odd byte,
    the top exponent bit of every little-endian float, is clear): casts then compare
    bit for bit with no NaN payload questions."""
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    b[1::2] &= 0xBF
    return b


def assert_box_plans(row: tuple) -> None:
    """A well-formed box (a row of `table`) plans into tiles (planned on the host: no pointer
    is touched), so its ill-formed neighbours fail for their named reason."""
    assert len(_C.plan_tiles(table([row]), 0)) > 0


def assert_box_refused(row: tuple) -> None:
    """An ill-formed box is refused by the copy and by the tile planner before any pointer
    is touched (validation runs first)."""
    tbl = table([row])
    with pytest.raises(Exception, match="bad box"):
        _C.copy_boxes_cpu(tbl)
    with pytest.raises(Exception, match="bad box"):
        _C.plan_tiles(tbl, 0)
