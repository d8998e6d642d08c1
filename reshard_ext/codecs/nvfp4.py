"""The NVFP4 codec's Python side: its kernel wrappers (the amax of a piece, the whole-piece
quantize, the per-tensor scale), its box codes and the pieces that bind its fused boxes
(csrc/kernels/codecs/nvfp4.h says what those boxes hold and the element math). Which
tensors convert, on which side, is the policy of the transform, rx.NVFP4
(reshard_ext/nvfp4.py).
"""
from __future__ import annotations

import math

import torch

from .. import _C
from ..errors import ReshardError
from ..layout import code_of
from ..transforms import Piece
from . import traits
from .mxfp8 import rows_view, swizzled_size

BLOCK = int(_C.NV_BLOCK)  # elements per E4M3 block scale
# The planner's cut grain of a packed data tensor (one coordinate = one byte = 2 elements):
# whole blocks per box.
GRAIN = traits("nvfp4").grain

SCALE_LAYOUTS = {"2d": int(_C.NV_SCALE_2D), "swizzled": int(_C.NV_SCALE_SWIZZLED)}


def scale_numel(shape: tuple[int, ...], scale_layout: str) -> int:
    """Bytes of the block-scale buffer for a local (unpacked) data shape [..., K]."""
    rows = math.prod(shape[:-1])
    scols = shape[-1] // BLOCK
    return rows * scols if scale_layout == "2d" else swizzled_size(rows, scols)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _rows(src: torch.Tensor, what: str) -> tuple[torch.Tensor, int, int, int]:
    if src.dtype != torch.bfloat16:
        raise ReshardError(f"NVFP4 {what}: source must be bfloat16, got {src.dtype}")
    view = rows_view(src)
    if view is None:
        src = src.contiguous()
        view = rows_view(src)
    rows, cols, row_stride = view  # type: ignore[misc]
    if cols % BLOCK:
        raise ReshardError(f"NVFP4 {what}: the last dim ({cols}) must be a multiple of {BLOCK}")
    return src, rows, cols, row_stride


def _cell_ok(cell: torch.Tensor, device: torch.device) -> None:
    if not (cell.dtype == torch.int32 and cell.numel() == 1 and cell.device == device):
        raise ReshardError("NVFP4: the amax cell must be one int32 on the source's device")


def amax_into(src: torch.Tensor, cell: torch.Tensor) -> None:
    """Max-accumulates the amax of BF16 `src` into `cell` (one int32: the FP32 bits of
    max |x|, NaN above everything): start it at 0, run it over every piece of a tensor."""
    src, rows, cols, row_stride = _rows(src, "amax")
    _cell_ok(cell, src.device)
    if src.is_cuda:
        _C.nvfp4_amax_cuda(src.data_ptr(), rows, cols, row_stride, cell.data_ptr(), _stream(src))
    else:
        _C.nvfp4_amax_cpu(src.data_ptr(), rows, cols, row_stride, cell.data_ptr())


def quantize(src: torch.Tensor, cell: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
             tensor_scale: torch.Tensor | None, scale_layout: str = "2d") -> None:
    """Quantizes BF16 `src` [..., K] under the amax in `cell` into contiguous `data`
    (K/2 bytes per row), `scale` (E4M3 bytes, 2-D or swizzled) and, when given,
    `tensor_scale` (one float32), on src's device (CUDA: on the current stream)."""
    src, rows, cols, row_stride = _rows(src, "quantize")
    _cell_ok(cell, src.device)
    want_scale = rows * (cols // BLOCK) if scale_layout == "2d" else swizzled_size(rows, cols // BLOCK)
    if not (data.is_contiguous() and data.numel() == rows * cols // 2 and data.element_size() == 1):
        raise ReshardError(f"NVFP4 quantize: data must be a contiguous 1-byte tensor of {rows * cols // 2} elements")
    if not (scale.is_contiguous() and scale.numel() == want_scale and scale.element_size() == 1):
        raise ReshardError(f"NVFP4 quantize: scale must be a contiguous 1-byte tensor of {want_scale} elements")
    if tensor_scale is not None and not (tensor_scale.dtype == torch.float32 and tensor_scale.numel() == 1):
        raise ReshardError("NVFP4 quantize: tensor_scale must be one float32")
    if not all(t.device == src.device for t in (data, scale) + ((tensor_scale,) if tensor_scale is not None else ())):
        raise ReshardError("NVFP4 quantize: source, data and scales must be on one device")
    args = (src.data_ptr(), rows, cols, row_stride, cell.data_ptr(), data.data_ptr(), scale.data_ptr(),
            SCALE_LAYOUTS[scale_layout], tensor_scale.data_ptr() if tensor_scale is not None else 0)
    if src.is_cuda:
        if not hasattr(_C, "nvfp4_quantize_cuda"):
            raise ReshardError("NVFP4 on CUDA tensors needs reshard_ext built with CUDA")
        _C.nvfp4_quantize_cuda(*args, _stream(src))
    else:
        _C.nvfp4_quantize_cpu(*args)


def tensor_scale_into(cell: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the per-tensor scale of the amax in `cell` into `out` (one float32)."""
    if out.is_cuda:
        _C.nvfp4_tensor_scale_cuda(cell.data_ptr(), out.data_ptr(), _stream(out))
    else:
        _C.nvfp4_tensor_scale_cpu(cell.data_ptr(), out.data_ptr())


def pairs(t: torch.Tensor) -> torch.Tensor:
    """A BF16 tensor [..., K] (unit last stride, K even) as int32 words of BF16 pairs
    [..., K/2]: the boxes' coordinates (one word in, one packed byte out)."""
    return t.view(torch.int32)


# ---- pieces that quantize inside the box kernels --------------------------------------

class SentFromSource(Piece):
    """A wire tensor (`name::nv.data` or `name::nv.scale`) that is never materialized:
    the pack and copy boxes read the BF16 source piece in place, as words of BF16 pairs,
    and quantize it (data) or compute its block scales (scale) under the tensor's amax
    in `cell`, read when the boxes run."""

    def __init__(self, source: torch.Tensor, cell: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                 kind: int):
        super().__init__(shape, dtype, source.device)
        self.source, self.words, self.cell, self.codec = source, pairs(source), cell, kind
        # A scale coordinate reads a whole block: 8 words of the source's last dim.
        self.grain = BLOCK // 2 if kind == int(_C.BOX_NV_SCALE) else 1

    def ref(self, whole: bool) -> _C.TensorRef:
        return _C.TensorRef(self.words.data_ptr(), self.words.stride(), code_of(torch.int32), codec=self.codec,
                            side=self.cell.data_ptr(), grain=self.grain)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.source, self.cell)
