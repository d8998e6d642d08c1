"""The blockwise FP8 codec's Python side: its kernel wrappers (the per-block scales from the
amax grid, the whole-piece quantize), its box code, the geometry of its scale tensors and
the piece that binds its fused source boxes (csrc/kernels/codecs/fp8block.h says what
those boxes hold). Which tensors convert, on which side, is the policy of the transform,
rx.FP8Block (reshard_ext/fp8block.py); the amaxes come from the pre-pass of codecs/amax.py.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import _C
from ..errors import ReshardError
from ..layout import Layout, Replicate, Shard, code_of
from ..transforms import Piece
from . import rows_view, stream_of, traits
from .amax import AmaxPiece

BLOCK = int(_C.FP8B_BLOCK)
ITEM = int(_C.FP8B_ITEM)
# The planner's cut grain of a data wire the boxes quantize: whole items per box row.
GRAIN = traits("fp8block").grain
SCALES = {"fp32": int(_C.FP8B_FP32), "pow2": int(_C.FP8B_POW2)}
# How each convention's amax treats NaN elements (codecs/amax.py NAN_MODES).
NAN = {"fp32": "propagate", "pow2": "ignore"}
SOURCES = (torch.bfloat16, torch.float32)

# How each converted piece of this process was last bound: (side, name) -> "fused"
# (quantized inside the pack/copy boxes), "staged" (a separate whole-piece pass) or
# "fp8" (an FP8 source moved with its scales). For tests and diagnostics.
PATHS: dict[tuple[str, str], str] = {}


def block_of(ndim: int) -> tuple[int, ...]:
    """The block of a tensor of `ndim` dims: 128 x 128 over the last two, each leading index alone."""
    return (1,) * (ndim - 2) + (BLOCK, BLOCK)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale_inv shape of a data shape: [..., ceil(N / 128), ceil(K / 128)]."""
    return shape[:-2] + tuple(-(-s // BLOCK) for s in shape[-2:])


# ---- kernels -----------------------------------------------------------------------

def scales_from_amax(amax: torch.Tensor, scales: str, scale_inv: torch.Tensor, mult: torch.Tensor) -> None:
    """Per cell of the amax grid (int32 FP32 patterns, codecs/amax.py): scale_inv (float32) and
    the boxes' factor (int32), on amax's device (CUDA: the current stream)."""
    n = amax.numel()
    if not (scale_inv.numel() == n == mult.numel() and scale_inv.dtype == torch.float32 and mult.dtype == torch.int32):
        raise ReshardError("blockwise FP8 scales: scale_inv (float32) and mult (int32) of the grid's size required")
    args = (amax.data_ptr(), n, SCALES[scales], scale_inv.data_ptr(), mult.data_ptr())
    if amax.is_cuda:
        _cuda("fp8block_scales_cuda")(*args, stream_of(amax))
    else:
        _C.fp8block_scales_cpu(*args)


def quantize_piece(src: torch.Tensor, rowmap: torch.Tensor, colmap: torch.Tensor, mult: torch.Tensor, scales: str,
                   data: torch.Tensor) -> None:
    """Quantizes the piece `src` (BF16 or FP32, rows that flatten) into contiguous E4M3 bytes
    `data`: element (r, c) under mult[rowmap[r] + colmap[c]]."""
    view = rows_view(src)
    if view is None or src.dtype not in SOURCES:
        raise ReshardError(f"blockwise FP8 quantize: a BF16 or FP32 piece whose rows flatten required, got {src.dtype}")
    rows, cols, row_stride = view
    if not (data.is_contiguous() and data.numel() == rows * cols and data.element_size() == 1):
        raise ReshardError(f"blockwise FP8 quantize: data must be a contiguous 1-byte tensor of {rows * cols} elements")
    if rows * cols == 0:
        return
    args = (src.data_ptr(), code_of(src.dtype), rows, cols, row_stride, rowmap.data_ptr(), colmap.data_ptr(),
            mult.data_ptr(), SCALES[scales], data.data_ptr())
    if src.is_cuda:
        _cuda("fp8block_quantize_cuda")(*args, stream_of(src))
    else:
        _C.fp8block_quantize_cpu(*args)


def _cuda(name: str):  # noqa: ANN202 - a _C function
    if not hasattr(_C, name):
        raise ReshardError("blockwise FP8 on CUDA tensors needs reshard_ext built with CUDA")
    return getattr(_C, name)


def codec(scales: str) -> int:
    """rx_box.codec of a blockwise FP8 box: the codec id | the scales convention << 8."""
    return int(_C.BOX_FP8B) | SCALES[scales] << 8


# ---- scale tensors: the block grid's shards ---------------------------------------------

def _cut_message(rank: int, dim: int, runs: list[tuple[int, int]], extent: int) -> str:
    """The first boundary of a rank's runs along `dim` that falls inside a block."""
    for start, n in runs:
        for at in (start, start + n):
            if n and at % BLOCK and at != extent:
                lo = at // BLOCK * BLOCK
                return (f"rank {rank}'s piece has a boundary at index {at} of dim {dim}, inside the {BLOCK}-element "
                        f"block [{lo}, {min(lo + BLOCK, extent)})")
    return f"rank {rank}'s piece cuts a {BLOCK}-element block of dim {dim}"


@functools.lru_cache(maxsize=4096)
def _scale_layout(layout: Layout) -> Layout | str:
    """The float32 layout of `layout`'s scale_inv when every piece holds its blocks whole
    (the scale tensor sharded alike), or the first boundary that cuts a block."""
    nd = len(layout.shape)
    if nd < 2:
        return "blockwise FP8 quantizes tensors of two or more dims (the last two are blocked)"
    placements = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim % nd >= nd - 2 and p.blocks is not None:
            if any(b % BLOCK for b in p.blocks):
                return f"packed blocks {p.blocks} of dim {p.dim % nd} are not multiples of {BLOCK}"
            p = Shard(p.dim, p.stride, tuple(b // BLOCK for b in p.blocks))
        placements.append(p)
    scale = Layout(scale_shape(layout.shape), torch.float32, layout.mesh, placements)
    for rank in sorted(set(layout.mesh.ranks)):
        runs = layout.runs(rank)
        assert runs is not None  # a rank of the mesh
        want: list[list[tuple[int, int]]] = [[(s, n) for s, n in r] for r in runs[:-2]]
        for d in (nd - 2, nd - 1):
            mine = [(s, n) for s, n in runs[d]]
            block_runs, aligned = _C.amax_block_runs(mine, layout.shape[d], BLOCK)
            if not aligned:
                return _cut_message(rank, d, mine, layout.shape[d])
            want.append([(s, n) for s, n in block_runs])
        got = scale.runs(rank) if not scale.error else None
        if got is None or [list(map(tuple, r)) for r in got] != want:
            return f"rank {rank}: the blocks of its piece do not form a shard of the scale tensor"
    return scale


def scale_layout(name: str, layout: Layout, what: str) -> Layout:
    """The scale_inv layout of `name`'s data (every piece holding whole blocks), or
    ReshardError naming the tensor and the boundary that cuts a block."""
    got = _scale_layout(layout)
    if isinstance(got, str):
        raise ReshardError(f"FP8Block cannot {what} {name!r} with layout {layout!r}: {got}; its scale_inv would not "
                           f"be a slice of the global {BLOCK}x{BLOCK} grid (shard the last two dims in whole "
                           f"{BLOCK}-element blocks)")
    return got


def replicated_scale_layout(layout: Layout) -> Layout:
    """The full scale grid on every rank of the mesh (the sources of a tensor whose pieces cut
    blocks: each holds the global grid after the amax reduction)."""
    return Layout(scale_shape(layout.shape), torch.float32, layout.mesh, [Replicate()] * layout.mesh.ndim)


def gather_index(layout: Layout, rank: int) -> torch.Tensor:
    """Flat indices into the scale grid of `rank`'s scale shard (an aligned piece's blocks, in
    its local order)."""
    runs = layout.runs(rank)
    assert runs is not None
    grid = scale_shape(layout.shape)
    per_dim = []
    for d, r in enumerate(runs):
        block = BLOCK if d >= len(grid) - 2 else 1
        cells, _ = _C.amax_block_runs(list(map(tuple, r)), layout.shape[d], block)
        per_dim.append(np.concatenate([np.arange(s, s + n) for s, n in cells]) if cells else np.zeros(0, np.int64))
    mesh = np.meshgrid(*per_dim, indexing="ij")
    flat = np.ravel_multi_index([m.ravel() for m in mesh], grid) if math.prod(grid) else np.zeros(0, np.int64)
    return torch.from_numpy(np.asarray(flat, dtype=np.int64))


# ---- pieces -------------------------------------------------------------------------------

class BlockScales:
    """The per-block scales of one tensor on this rank: its amax pre-pass piece, the scale_inv
    and factor of every cell of the grid, refreshed by `update` from the reduced amaxes."""

    def __init__(self, amax: AmaxPiece, scales: str):
        self.amax, self.scales = amax, scales
        n, dev = amax.grid_of.numel, amax.grid.device
        self.scale_inv = torch.empty(n, dtype=torch.float32, device=dev)
        self.mult = torch.empty(n, dtype=torch.int32, device=dev)

    def update(self) -> None:
        scales_from_amax(self.amax.grid, self.scales, self.scale_inv, self.mult)

    def quantize(self, data: torch.Tensor) -> None:
        """The piece the amaxes were last taken of into contiguous E4M3 `data`."""
        quantize_piece(self.amax.source, self.amax.rowmap, self.amax.colmap, self.mult, self.scales, data)


class SentFromSource(Piece):
    """The E4M3 data wire `name::fp8.data`, never materialized: the pack and copy boxes read
    the BF16/FP32 source piece in place and quantize it with the block factors of `scales`
    (params: the Side record, the piece's row stride)."""

    def __init__(self, source: torch.Tensor, scales: BlockScales):
        super().__init__(tuple(source.shape), torch.float8_e4m3fn, source.device)
        view = rows_view(source)
        assert view is not None  # the transform checked it
        self.source, self.scales, self.row_stride = source, scales, view[2]
        amax = scales.amax
        # The Side record (codecs/fp8block.h): three device pointers the boxes read.
        self.side = torch.tensor([scales.mult.data_ptr(), amax.rowmap.data_ptr(), amax.colmap.data_ptr()],
                                 dtype=torch.int64).to(source.device)
        assert self.side.numel() * 8 == int(_C.FP8B_SIDE_BYTES)

    def ref(self, whole: bool) -> _C.TensorRef:
        return _C.TensorRef(self.source.data_ptr(), self.source.stride(), code_of(self.source.dtype),
                            codec=codec(self.scales.scales), side=self.side.data_ptr(), arg=self.row_stride)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.source,)
