"""rx.MXFP8: BF16 -> MXFP8 on the fly during a refit (DESIGN section 5).

A converted destination is a pair of persistent buffers ``(data, scale)``: data is
``float8_e4m3fn`` of the local shape ``[..., K]``, scale holds one E8M0 byte (``uint8``
or ``float8_e8m0fnu``) per 32 elements along the last dim, either row-major
``[M, ceil(K/32)]`` (``scale_layout="2d"``; M = product of the leading dims) or the
swizzled 128x4-tile layout cuBLAS block scaling reads (``"swizzled"``, padded to 128
rows and 4 scale columns, padding 0). Every refit rewrites the same buffers, so CUDA
graphs that captured them stay valid.

- ``where="receiver"``: BF16 on the wire. Fused (no extra memory, no extra pass): with
  a local last dim K % 32 == 0 and every incoming box (receive or same-rank copy)
  reading BF16 in whole 32-element blocks, the unpack and copy boxes quantize on the
  way, writing data and scales directly: each block's scale byte goes where its (row,
  block column) in the local [M, K] data puts it, row-major for ``"2d"``, the 128x4
  tiles for ``"swizzled"`` (csrc/kernels/codecs/mxfp8.h, RX_CODEC_MXFP8). The boxes never write
  the swizzled padding: binding the plan zeroes it once (and leaves the scales alone,
  so an engine can keep reading them until the refit); it stays 0 as long as nothing
  else writes there. Otherwise (a partial final block, sources sharded off the
  32-grid, a same-rank copy from a non-BF16 source) the wire lands in a persistent
  BF16 staging tensor and ``after`` quantizes the whole piece once. Each rank decides
  on its own when the plan binds.
- ``where="sender"``: the wire carries ``name::mx.data`` (E4M3) and ``name::mx.scale``
  (uint8), 1 + 1/32 bytes per element (51.6% of BF16), landing directly in the
  destination buffers (swizzled scales land in a 2-D staging and are swizzled after).
  Fused: for a BF16 source with unit last-dim stride and a global K % 32 == 0, the pack
  and copy boxes read the source in place and quantize (data) or compute the block
  scales (scale) on the way. Otherwise each execute first quantizes the source into
  persistent wire tensors.

Either way the result equals quantizing the whole logical tensor, byte for byte. That
needs every piece's last-dim runs to consist of whole 32-element blocks aligned on the
global grid (a partial final block at the end of the dim is fine); other pieces raise
ReshardError naming the tensor.

Element policy: amax over the finite elements of a block (NaN and +-Inf ignored); scale
by ``rounding`` ("ceil": 2^ceil(log2(amax/448)); "floor": OCP MX v1.0,
2^(floor(log2 amax) - 8)); all-zero blocks get the smallest scale (biased 0); elements
round to nearest even and saturate to +-448 (Inf too); NaN stays NaN (0x7f | sign).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _C
from .codecs import check_pair
from .codecs.coarse import coarse_layout_or_error
from .codecs.mxfp8 import (
    BLOCK,
    GRAIN,
    PATHS,
    ROUNDINGS,
    SCALE_LAYOUTS,
    ReceivedData,
    SentFromSource,
    quantize,
    receiver_digest,
    rows_view,
    scale_cols,
    scale_numel,
    scales_landing,
    swizzle,
    swizzled_size,
)
from .errors import ReshardError
from .layout import Layout
from .transforms import Rewrite, Transform, name_selector

DATA_SUFFIX = "::mx.data"
SCALE_SUFFIX = "::mx.scale"
_SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


# ---- layouts of the wire tensors ---------------------------------------------------

def data_layout(layout: Layout) -> Layout:
    return layout.with_dtype(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=4096)
def _scale_layout_or_error(layout: Layout) -> Layout | str:
    """The uint8 layout of the scales of `layout`'s data (codecs/coarse.py), or why there is none."""
    k = layout.shape[-1] if layout.shape else 0
    return coarse_layout_or_error(layout, scale_cols(k), torch.uint8, BLOCK, BLOCK,
                                  lambda run: _C.mxfp8_scale_runs(run, k))


def scale_layout(name: str, layout: Layout) -> Layout:
    """The uint8 scale layout of `name`'s data, or ReshardError naming the tensor."""
    got = _scale_layout_or_error(layout)
    if isinstance(got, str):
        raise ReshardError(
            f"MXFP8 cannot convert {name!r} with layout {layout!r}: {got}; quantizing that piece "
            f"alone would differ from quantizing the logical tensor (shard the last dim in whole "
            f"{BLOCK}-element blocks)")
    return got


# ---- the transform -----------------------------------------------------------------

Params = Iterable[str] | Callable[[str], bool]


class MXFP8(Transform):
    """Converts the selected BF16 tensors to MXFP8 on the way (see the module doc).

    params: the dst names to convert: an iterable of names or a predicate name -> bool.
    group: the plan's process group; only used to find this rank's piece when a data
        buffer is given flattened (fewer dims than the layout). Default WORLD.
    """

    def __init__(self, params: Params, scale_layout: str = "2d", where: str = "receiver",
                 rounding: str = "ceil", group: Any = None):
        if scale_layout not in SCALE_LAYOUTS:
            raise ReshardError(f"MXFP8 scale_layout must be one of {sorted(SCALE_LAYOUTS)}, got {scale_layout!r}")
        if where not in ("receiver", "sender"):
            raise ReshardError(f"MXFP8 where must be 'receiver' or 'sender', got {where!r}")
        if rounding not in ROUNDINGS:
            raise ReshardError(f"MXFP8 rounding must be one of {sorted(ROUNDINGS)}, got {rounding!r}")
        self._select, self._params_key = name_selector(params)
        self.scale_layout = scale_layout
        self.where = where
        self.rounding = rounding
        self.group = group

    def cache_key(self) -> tuple:
        return (type(self).__name__, self._params_key, self.scale_layout, self.where, self.rounding)

    def last_dim_grain(self, name: str) -> int | None:
        # The tensors whose boxes quantize: the BF16 dst (receiver) or the data wire (sender);
        # a scale wire's elements are whole blocks already, so it keeps the plain cut.
        if self.where == "sender":
            if not name.endswith(DATA_SUFFIX):
                return None
            name = name[:-len(DATA_SUFFIX)]
        return GRAIN if self._select(name) else None

    def receiver_codec(self, name: str) -> _C.ReceiverCodec | None:
        return receiver_digest(self.rounding) if self.where == "receiver" and self._select(name) else None

    def _rank(self) -> int:
        from . import groups

        return groups.rank(self.group) if groups.usable(self.group) else 0

    # -- sender side: quantize the source piece into the wire tensors ------------------
    def rewrite_src(self, name: str, tensor: torch.Tensor, layout: Layout) -> Rewrite | None:
        if self.where != "sender" or not self._select(name) or layout.error:
            return None
        slayout = scale_layout(name, layout)
        if not tensor.dtype.is_floating_point:
            raise ReshardError(f"MXFP8 converts {name!r}: its source must be floating point, got {tensor.dtype}")
        shape = tuple(tensor.shape)
        if len(shape) != len(layout.shape):
            return None  # a malformed entry: let the planner report it
        slocal = shape[:-1] + (scale_cols(shape[-1]),)
        # Whole blocks everywhere (K % 32 == 0; the layouts of both sides are checked to be
        # block-aligned and the planner cuts rows only between blocks): the boxes
        # quantize the BF16 source in place, no wire tensors.
        if (tensor.dtype == torch.bfloat16 and layout.shape[-1] % BLOCK == 0
                and (shape[-1] == 0 or tensor.stride(-1) == 1)):
            PATHS[("src", name)] = "fused"
            return Rewrite(entries={
                name + DATA_SUFFIX: (SentFromSource(tensor, shape, torch.float8_e4m3fn, int(_C.BOX_MX_DATA),
                                                     self.rounding), data_layout(layout)),
                name + SCALE_SUFFIX: (SentFromSource(tensor, slocal, torch.uint8, int(_C.BOX_MX_SCALE), self.rounding),
                                      slayout)})
        PATHS[("src", name)] = "staged"
        wire_data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=tensor.device)
        wire_scale = torch.empty(slocal, dtype=torch.uint8, device=tensor.device)
        # BF16 pieces with flattenable rows are read in place; anything else goes through
        # a persistent BF16 copy (the cast rounds as Tensor.to does).
        stage = tensor if tensor.dtype == torch.bfloat16 and rows_view(tensor) else \
            torch.empty(shape, dtype=torch.bfloat16, device=tensor.device)

        def before() -> None:
            if stage is not tensor:
                stage.copy_(tensor)
            quantize(stage, wire_data.view(torch.uint8), wire_scale, "2d", self.rounding)

        return Rewrite(entries={name + DATA_SUFFIX: (wire_data, data_layout(layout)),
                                name + SCALE_SUFFIX: (wire_scale, slayout)},
                       before=before)

    # -- receiver side ------------------------------------------------------------------
    def rewrite_dst(self, name: str, target: Any, layout: Layout) -> Rewrite | None:
        if not self._select(name) or layout.error:
            return None
        if not (isinstance(target, (tuple, list)) and len(target) == 2
                and all(isinstance(t, torch.Tensor) for t in target)):
            raise ReshardError(f"MXFP8 converts {name!r}: its destination must be a (data, scale) pair of tensors")
        data, scale = target
        slayout = scale_layout(name, layout)
        # A data buffer of the layout's rank is the local shape (the planner checks it
        # against the layout); a flattened one needs this rank's piece.
        local = tuple(data.shape) if data.dim() == len(layout.shape) else layout.local_shape(self._rank())
        if local is None:
            raise ReshardError(f"MXFP8 converts {name!r}: this rank holds no piece of {layout!r}")
        self._check_buffers(name, data, scale, local)
        data_b = data.view(torch.uint8)
        scale_b = scale.view(torch.uint8)

        if self.where == "receiver" and local[-1] > 0 and local[-1] % BLOCK == 0:
            piece = ReceivedData(name, data_b, scale_b, local, self.scale_layout, self.rounding)
            return Rewrite(entries={name: (piece, layout.with_dtype(torch.bfloat16))}, after=piece.after)
        if self.where == "receiver":
            PATHS[("dst", name)] = "staged"
            staging = torch.empty(local, dtype=torch.bfloat16, device=data.device)

            def after() -> None:
                quantize(staging, data_b, scale_b, self.scale_layout, self.rounding)

            return Rewrite(entries={name: (staging, layout.with_dtype(torch.bfloat16))}, after=after)

        entries = {name + DATA_SUFFIX: (data.view(torch.float8_e4m3fn).view(local), data_layout(layout))}
        landing, after_landing = scales_landing(scale_b, local[:-1] + (scale_cols(local[-1]),), self.scale_layout)
        entries[name + SCALE_SUFFIX] = (landing, slayout)
        return Rewrite(entries=entries, after=after_landing)

    def _check_buffers(self, name: str, data: torch.Tensor, scale: torch.Tensor, local: tuple[int, ...]) -> None:
        check_pair(f"MXFP8 destination {name!r}", data, local, scale, _SCALE_DTYPES,
                   scale_numel(local, self.scale_layout), f"scale ({self.scale_layout})")


def wire_bytes_per_element(where: str) -> float:
    """Bytes on the wire per element of a converted tensor."""
    return 2.0 if where == "receiver" else 1.0 + 1.0 / BLOCK


__all__ = ["MXFP8", "quantize", "swizzle", "scale_layout", "data_layout", "scale_numel",
           "swizzled_size", "DATA_SUFFIX", "SCALE_SUFFIX"]
