"""The MXFP8 codec's Python side: its kernel wrappers (whole-tensor quantize and swizzle),
its box codes and the pieces that bind its fused boxes (csrc/kernels/codecs/mxfp8.h says
what those boxes hold). Which tensors convert, on which side, is the policy of the
transform, rx.MXFP8 (reshard_ext/mxfp8.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .. import _C
from ..errors import ReshardError
from ..layout import code_of
from ..transforms import Piece
from . import rows_view, stream_of, traits

BLOCK = int(_C.MX_BLOCK)
# The planner's cut grain of a tensor the data boxes quantize: whole blocks per box.
GRAIN = traits("mxfp8").grain

SCALE_LAYOUTS = {"2d": int(_C.MX_SCALE_2D), "swizzled": int(_C.MX_SCALE_SWIZZLED)}
ROUNDINGS = {"ceil": int(_C.MX_ROUND_CEIL), "floor": int(_C.MX_ROUND_FLOOR)}


# ---- kernels -----------------------------------------------------------------------

def scale_cols(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK


def swizzled_size(rows: int, scols: int) -> int:
    return int(_C.mxfp8_swizzled_size(rows, scols))


def scale_numel(shape: tuple[int, ...], scale_layout: str) -> int:
    """Bytes of the scale buffer for a local data shape."""
    rows = math.prod(shape[:-1])
    scols = scale_cols(shape[-1])
    return rows * scols if scale_layout == "2d" else swizzled_size(rows, scols)


def quantize(src: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
             scale_layout: str = "2d", rounding: str = "ceil") -> None:
    """Quantizes BF16 `src` [..., K] into contiguous `data` (E4M3 bytes, same numel) and
    `scale` (E8M0 bytes), on src's device (CUDA: on the current stream)."""
    if src.dtype != torch.bfloat16:
        raise ReshardError(f"MXFP8 quantize: source must be bfloat16, got {src.dtype}")
    view = rows_view(src)
    if view is None:
        src = src.contiguous()
        view = rows_view(src)
    rows, cols, row_stride = view  # type: ignore[misc]
    scols = scale_cols(cols)
    want_scale = rows * scols if scale_layout == "2d" else swizzled_size(rows, scols)
    if not (data.is_contiguous() and data.numel() == rows * cols and data.element_size() == 1):
        raise ReshardError(f"MXFP8 quantize: data must be a contiguous 1-byte tensor of {rows * cols} elements")
    if not (scale.is_contiguous() and scale.numel() == want_scale and scale.element_size() == 1):
        raise ReshardError(f"MXFP8 quantize: scale must be a contiguous 1-byte tensor of {want_scale} elements")
    if not (src.device == data.device == scale.device):
        raise ReshardError("MXFP8 quantize: source, data and scale must be on one device")
    args = (src.data_ptr(), rows, cols, row_stride, data.data_ptr(), scale.data_ptr(),
            SCALE_LAYOUTS[scale_layout], ROUNDINGS[rounding])
    if src.is_cuda:
        if not hasattr(_C, "mxfp8_quantize_cuda"):
            raise ReshardError("MXFP8 on CUDA tensors needs reshard_ext built with CUDA")
        _C.mxfp8_quantize_cuda(*args, stream_of(src))
    else:
        _C.mxfp8_quantize_cpu(*args)


def swizzle(scale2d: torch.Tensor, out: torch.Tensor) -> None:
    """Rewrites a contiguous [rows, scols] scale matrix into the swizzled layout `out`."""
    rows, scols = math.prod(scale2d.shape[:-1]), scale2d.shape[-1]
    if not (scale2d.is_contiguous() and out.is_contiguous() and out.numel() == swizzled_size(rows, scols)):
        raise ReshardError("MXFP8 swizzle: contiguous [rows, scols] input and a swizzled-size output required")
    if scale2d.is_cuda:
        _C.mxfp8_swizzle_cuda(scale2d.data_ptr(), rows, scols, out.data_ptr(), stream_of(scale2d))
    else:
        _C.mxfp8_swizzle_cpu(scale2d.data_ptr(), rows, scols, out.data_ptr())


def scales_landing(scale: torch.Tensor, slocal: tuple[int, ...],
                   scale_layout: str) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Where a destination's [rows, scols] block scales land (`scale`: the user's buffer, as
    bytes), and the step after the transfer: "2d" lands in place; "swizzled" lands in a 2-D
    scratch that is then swizzled into the buffer (MXFP8 and NVFP4 share the 128x4 tiles)."""
    if scale_layout == "2d":
        return scale.view(slocal), None
    scale2d = torch.empty(slocal, dtype=torch.uint8, device=scale.device)
    return scale2d, lambda: swizzle(scale2d, scale)


# ---- box codes -----------------------------------------------------------------------

def codec(kind: int, rounding: str, layout: str = "2d") -> int:
    """rx_box.codec of an MXFP8 box (csrc/kernels/codecs/mxfp8.h): the codec id
    (_C.BOX_MX_DATA or _C.BOX_MX_SCALE) | rounding << 8 | scale layout << 16."""
    return kind | ROUNDINGS[rounding] << 8 | SCALE_LAYOUTS[layout] << 16


def receiver_digest(rounding: str) -> _C.ReceiverCodec:
    """How verify digests a BF16 copy whose receiver quantizes it after it lands."""
    return _C.ReceiverCodec(int(_C.DIGEST_MX) | ROUNDINGS[rounding] << 8, BLOCK, code_of(torch.bfloat16))


# ---- pieces that quantize inside the box kernels --------------------------------------

# How each converted piece of this process was last bound: (side, name) -> "fused"
# (quantized inside the pack/unpack/copy boxes) or "staged" (a BF16 staging or wire
# tensor plus a separate quantize pass). For tests and diagnostics.
PATHS: dict[tuple[str, str], str] = {}


def _zero_swizzled_padding(scale: torch.Tensor, rows: int, scols: int) -> None:
    """Zeroes the padding bytes of a swizzled scale buffer and leaves its scales alone:
    binding a plan must not disturb scales an engine may still read before the refit.
    The fused boxes write only the scales of real blocks, so this, once per bind, is
    what keeps the padding 0."""
    real = torch.ones((rows, scols), dtype=torch.uint8, device=scale.device)
    where = torch.empty_like(scale)
    swizzle(real, where)  # 1 at every real scale, 0 in the padding
    scale.masked_fill_(where == 0, 0)


class ReceivedData(Piece):
    """The BF16 destination piece the wire lands in, bound as the (data, scale) pair
    itself when every incoming box holds whole BF16 blocks (unpack and same-rank copy
    quantize on the way and place each block's scale, 2-D or swizzled: no staging),
    else as a BF16 staging tensor that `after` quantizes once the whole piece arrived."""

    def __init__(self, name: str, data: torch.Tensor, scale: torch.Tensor, local: tuple[int, ...],
                 scale_layout: str, rounding: str):
        super().__init__(local, torch.bfloat16, data.device, group=BLOCK)
        self.name, self.data, self.scale = name, data.view(local), scale
        self.given = data  # the caller's tensor (self.data views it)
        self.scale_layout, self.rounding = scale_layout, rounding
        self.staging: torch.Tensor | None = None

    def ref(self, whole: bool) -> _C.TensorRef:
        PATHS[("dst", self.name)] = "fused" if whole else "staged"
        if whole:
            self.staging = None
            cols = self.shape[-1]
            if self.scale_layout == "swizzled":
                _zero_swizzled_padding(self.scale, math.prod(self.shape[:-1]), scale_cols(cols))
            return _C.TensorRef(self.data.data_ptr(), self.data.stride(), code_of(self.data.dtype),
                                codec=codec(int(_C.BOX_MX_DATA), self.rounding, self.scale_layout),
                                side=self.scale.data_ptr(), arg=cols)
        if self.staging is None:
            self.staging = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
        return _C.TensorRef(self.staging.data_ptr(), self.staging.stride(), code_of(torch.bfloat16))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.given, self.scale)

    def after(self) -> None:
        if self.staging is not None:
            quantize(self.staging, self.data.view(-1), self.scale, self.scale_layout, self.rounding)


class SentFromSource(Piece):
    """A wire tensor (`name::mx.data` or `name::mx.scale`) that is never materialized:
    the pack and copy boxes read the BF16 source piece in place and quantize it (data)
    or compute its block scales (scale) on the way."""

    def __init__(self, source: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, kind: int, rounding: str):
        super().__init__(shape, dtype, source.device)
        self.source, self.codec = source, codec(kind, rounding)
        # A scale coordinate reads a whole block of the source's last dim.
        self.grain = BLOCK if kind == int(_C.BOX_MX_SCALE) else 1

    def ref(self, whole: bool) -> _C.TensorRef:
        return _C.TensorRef(self.source.data_ptr(), self.source.stride(), code_of(torch.bfloat16), codec=self.codec,
                            grain=self.grain)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.source,)
