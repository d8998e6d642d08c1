"""The NVFP4 codec's Python side: its kernel wrappers (the whole-piece quantize under a
given amax, the per-tensor scale), its box codes and the pieces that bind its fused boxes
(csrc/kernels/codecs/nvfp4.h says what those boxes hold and the element math). The
tensor's global amax comes from the amax pre-pass (reshard_ext/codecs/amax.py); which
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
from . import rows_view, stream_of, traits
from .mxfp8 import swizzled_size

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


def quantize(src: torch.Tensor, cell: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
             tensor_scale: torch.Tensor | None, scale_layout: str = "2d") -> None:
    """Quantizes BF16 `src` [..., K] under the amax in `cell` (one int32: the FP32 bits of
    the whole tensor's max |x|, an AmaxPiece's grid) into contiguous `data` (K/2 bytes per
    row), `scale` (E4M3 bytes, 2-D or swizzled) and, when given, `tensor_scale` (one
    float32), on src's device (CUDA: on the current stream)."""
    if src.dtype != torch.bfloat16:
        raise ReshardError(f"NVFP4 quantize: source must be bfloat16, got {src.dtype}")
    view = rows_view(src)
    if view is None:
        src = src.contiguous()
        view = rows_view(src)
    rows, cols, row_stride = view  # type: ignore[misc]
    if cols % BLOCK:
        raise ReshardError(f"NVFP4 quantize: the last dim ({cols}) must be a multiple of {BLOCK}")
    want_scale = rows * (cols // BLOCK) if scale_layout == "2d" else swizzled_size(rows, cols // BLOCK)
    if not (cell.dtype == torch.int32 and cell.numel() == 1):
        raise ReshardError("NVFP4 quantize: the amax cell must be one int32")
    if not (data.is_contiguous() and data.numel() == rows * cols // 2 and data.element_size() == 1):
        raise ReshardError(f"NVFP4 quantize: data must be a contiguous 1-byte tensor of {rows * cols // 2} elements")
    if not (scale.is_contiguous() and scale.numel() == want_scale and scale.element_size() == 1):
        raise ReshardError(f"NVFP4 quantize: scale must be a contiguous 1-byte tensor of {want_scale} elements")
    if tensor_scale is not None and not (tensor_scale.dtype == torch.float32 and tensor_scale.numel() == 1):
        raise ReshardError("NVFP4 quantize: tensor_scale must be one float32")
    outs = (cell, data, scale) + ((tensor_scale,) if tensor_scale is not None else ())
    if not all(t.device == src.device for t in outs):
        raise ReshardError("NVFP4 quantize: source, amax cell, data and scales must be on one device")
    args = (src.data_ptr(), rows, cols, row_stride, cell.data_ptr(), data.data_ptr(), scale.data_ptr(),
            SCALE_LAYOUTS[scale_layout], tensor_scale.data_ptr() if tensor_scale is not None else 0)
    if src.is_cuda:
        if not hasattr(_C, "nvfp4_quantize_cuda"):
            raise ReshardError("NVFP4 on CUDA tensors needs reshard_ext built with CUDA")
        _C.nvfp4_quantize_cuda(*args, stream_of(src))
    else:
        _C.nvfp4_quantize_cpu(*args)


def as_bf16_amax(cell: torch.Tensor) -> None:
    """Rounds the amax in `cell` (FP32 bits) to BF16 in place: the amax of a source read
    in another float type is then the amax of its BF16 cast (rounding is monotonic), which
    is what the codec quantizes."""
    cell.copy_(cell.view(torch.float32).to(torch.bfloat16).to(torch.float32).view(torch.int32))


def tensor_scale_into(cell: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the per-tensor scale of the amax in `cell` into `out` (one float32), on
    out's device (CUDA: on the current stream)."""
    if out.is_cuda:
        _C.nvfp4_tensor_scale_cuda(cell.data_ptr(), out.data_ptr(), stream_of(out))
    else:
        _C.nvfp4_tensor_scale_cpu(cell.data_ptr(), out.data_ptr())


def words(t: torch.Tensor) -> torch.Tensor | None:
    """A BF16 piece [..., K] as the int32 words of its BF16 pairs [..., K/2] (the boxes'
    coordinates: one word in, one packed byte out), or None where it has no such view
    (a strided last dim, an odd offset)."""
    if t.dim() == 0 or t.shape[-1] % 2 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return None
    try:
        return t.view(torch.int32)
    except RuntimeError:
        return None


# How each converted source piece of this process was last bound: (side, name) -> "fused"
# (quantized inside the pack/copy boxes) or "staged" (a separate quantize into wire
# tensors first). For tests and diagnostics.
PATHS: dict[tuple[str, str], str] = {}


class SentFromSource(Piece):
    """A wire tensor (`name::nv.data` [..., K/2] or `name::nv.scale` [..., K/16], uint8)
    that is never materialized: the pack and copy boxes read the BF16 source piece in place
    as words of BF16 pairs and quantize it (data) or compute its block scales (scale)
    under the tensor's amax in `cell` (an AmaxPiece grid, reduced before the boxes run)."""

    def __init__(self, source: torch.Tensor, pairs: torch.Tensor, cell: torch.Tensor, shape: tuple[int, ...],
                 kind: int):
        super().__init__(shape, torch.uint8, source.device)
        self.source, self.pairs, self.cell, self.codec = source, pairs, cell, kind
        # A scale coordinate reads a whole block: 8 words of the source's last dim.
        self.grain = BLOCK // 2 if kind == int(_C.BOX_NV_SCALE) else 1

    def ref(self, whole: bool) -> _C.TensorRef:
        return _C.TensorRef(self.pairs.data_ptr(), self.pairs.stride(), code_of(torch.int32), codec=self.codec,
                            side=self.cell.data_ptr(), grain=self.grain)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.source, self.cell)
