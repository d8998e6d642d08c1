"""rx.NVFP4: BF16 -> NVFP4 during a refit, byte-identical to torchao's NVFP4 reference.

A converted destination is a triple of persistent buffers ``(data, scale, tensor_scale)``:

- ``data``: ``uint8`` (or ``float4_e2m1fn_x2``) of the local shape ``[..., K/2]``: E2M1
  values packed two per byte, element 2i in the low nibble (torchao's ``qdata``; vLLM
  ModelOpt NVFP4's ``weight``);
- ``scale``: ``float8_e4m3fn`` (or ``uint8``), one E4M3 scale per 16 elements along the
  last dim, row-major ``[M, K/16]`` (``scale_layout="2d"``, M = product of the leading
  dims; the checkpoint layout of ModelOpt's ``weight_scale``) or the swizzled 128x4-tile
  layout Blackwell block-scaled GEMMs read (``"swizzled"``, padded to 128 rows and 4
  scale columns, padding 0: what torchao's ``is_swizzled_scales=True`` and vLLM's
  ``swizzle_blockscale`` hold);
- ``tensor_scale``: one ``float32`` (0-d or ``[1]``): the per-tensor scale
  ``amax / (448 * 6)`` of the GLOBAL tensor (torchao's ``per_tensor_scale`` from
  ``per_tensor_amax_to_scale(max |x|)``; ModelOpt's ``weight_scale_2``). Dequantized,
  ``x ~= e2m1 * float(scale) * tensor_scale``.

K must be a multiple of 16 (torchao asserts the same); every piece's last-dim runs must
be whole 16-element blocks of the logical tensor. Sources are quantized as BF16 (other
floating sources are cast to BF16 first, as Tensor.to rounds).

The per-tensor scale needs the amax of the whole tensor before any block is quantized:
at the start of every execute the source ranks reduce it over their pieces (the amax
pre-pass, reshard_ext/codecs/amax.py: one int32 per tensor between the ranks of its
source mesh, nothing where every source piece is whole), so every layout works.

- ``where="receiver"``: BF16 on the wire, plus the tensor's amax (``name::nv.amax``, 4
  bytes per receiving rank); the receiver quantizes its piece once it has landed
  (``after``), into the three buffers.
- ``where="sender"``: the wire carries ``name::nv.data`` (packed bytes),
  ``name::nv.scale`` (E4M3 bytes, 2-D) and ``name::nv.tscale`` (the float32): 1/2 + 1/16
  bytes per element plus 4 per tensor (28.1% of BF16), landing directly in the
  destination buffers (swizzled scales land in a 2-D staging and are swizzled after).
  Fused: for a BF16 source whose last dim has unit stride, the pack and copy boxes read
  the source in place (as int32 words of BF16 pairs) and quantize (data) or compute the
  block scales (scale) on the way (csrc/kernels/codecs/nvfp4.h). Otherwise each execute
  first quantizes the source piece into persistent wire tensors (``before``).

Element policy (csrc/kernels/codecs/nvfp4.h): torchao's FP32 math step for step, with
x86 torch's NaN results: a NaN anywhere makes every scale 0x7f and every byte 0x33; an
all-zero tensor gets scales 0xff and bytes 0xcc (0/0 in the reference); blocks of a
tensor holding +-Inf get 0xff/0xcc where they hold an Inf, scale 0x08 and +-0 elsewhere.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _C
from .codecs import rows_view
from .codecs.amax import AmaxPiece
from .codecs.coarse import coarse_layout_or_error
from .codecs.mxfp8 import scales_landing
from .codecs.nvfp4 import (
    BLOCK,
    GRAIN,
    PATHS,
    SCALE_LAYOUTS,
    SentFromSource,
    as_bf16_amax,
    quantize,
    scale_numel,
    tensor_scale_into,
    words,
)
from .errors import ReshardError
from .layout import Layout, Replicate
from .transforms import Rewrite, Transform, name_selector

DATA_SUFFIX = "::nv.data"
SCALE_SUFFIX = "::nv.scale"
TSCALE_SUFFIX = "::nv.tscale"
AMAX_SUFFIX = "::nv.amax"
_DATA_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


# ---- layouts of the wire tensors ---------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _coarse_layout_or_error(layout: Layout, per: int, dtype: torch.dtype) -> Layout | str:
    """The layout of a tensor whose last-dim coordinate covers `per` elements of
    `layout`'s (2: packed data; 16: block scales; codecs/coarse.py), or why there is none."""
    k = layout.shape[-1] if layout.shape else 0
    return coarse_layout_or_error(layout, k // per, dtype, per, BLOCK, lambda run: _C.nvfp4_coarse_runs(run, k, per))


def coarse_layout(name: str, layout: Layout, per: int, dtype: torch.dtype) -> Layout:
    """The packed (per=2) or scale (per=16) layout of `name`, or ReshardError naming it."""
    got = _coarse_layout_or_error(layout, per, dtype)
    if isinstance(got, str):
        raise ReshardError(
            f"NVFP4 cannot convert {name!r} with layout {layout!r}: {got}; quantizing that piece alone "
            f"would differ from quantizing the logical tensor (shard the last dim in whole {BLOCK}-element "
            f"blocks)")
    return got


def scalar_layout(layout: Layout, dtype: torch.dtype) -> Layout:
    """One value per tensor (its per-tensor scale, or its amax) that every rank of the mesh holds."""
    return Layout((1,), dtype, layout.mesh, [Replicate()] * len(layout.mesh.shape))


# ---- the transform -----------------------------------------------------------------

Params = Iterable[str] | Callable[[str], bool]


class NVFP4(Transform):
    """Converts the selected BF16 tensors to NVFP4 on the way (see the module doc).

    params: the dst names to convert: an iterable of names or a predicate name -> bool.
    group: the plan's process group (default WORLD): this rank's position in it, which the
        amax pre-pass needs (and a data buffer given flattened, to find this rank's piece).
    """

    def __init__(self, params: Params, scale_layout: str = "2d", where: str = "receiver", group: Any = None):
        if scale_layout not in SCALE_LAYOUTS:
            raise ReshardError(f"NVFP4 scale_layout must be one of {sorted(SCALE_LAYOUTS)}, got {scale_layout!r}")
        if where not in ("receiver", "sender"):
            raise ReshardError(f"NVFP4 where must be 'receiver' or 'sender', got {where!r}")
        self._select, self._params_key = name_selector(params)
        self.scale_layout = scale_layout
        self.where = where
        self.group = group

    def cache_key(self) -> tuple:
        return (type(self).__name__, self._params_key, self.scale_layout, self.where)

    def last_dim_grain(self, name: str) -> int | None:
        # The packed data wire's boxes quantize whole blocks (8 words); the scale wire's
        # elements are whole blocks already, so it keeps the plain cut.
        if self.where == "sender" and name.endswith(DATA_SUFFIX) and self._select(name[:-len(DATA_SUFFIX)]):
            return GRAIN
        return None

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    # -- source side: the global amax; the sender quantizes its piece into the wire tensors --
    def rewrite_src(self, name: str, tensor: torch.Tensor, layout: Layout) -> Rewrite | None:
        if not self._select(name) or layout.error:
            return None
        if not tensor.dtype.is_floating_point:
            raise ReshardError(f"NVFP4 converts {name!r}: its source must be floating point, got {tensor.dtype}")
        if self.where == "sender":
            dlayout = coarse_layout(name, layout, 2, torch.uint8)
            slayout = coarse_layout(name, layout, BLOCK, torch.uint8)
        shape = tuple(tensor.shape)
        if len(shape) != len(layout.shape) or shape != layout.local_shape(self._rank()):
            return None  # a malformed entry: let the planner report it
        # The whole tensor's amax, reduced over the source pieces before any data moves; for
        # a source read in another float type, rounded to the amax of its BF16 cast.
        amax = AmaxPiece(name, layout, tensor, self._rank(), layout.shape, nan="propagate")
        cell = amax.grid.view(1)
        if self.where == "receiver":
            return Rewrite(entries={name: (tensor, layout),
                                    name + AMAX_SUFFIX: (cell, scalar_layout(layout, torch.int32))},
                           before=None if tensor.dtype == torch.bfloat16 else lambda: as_bf16_amax(cell),
                           prepass=amax)
        dev = tensor.device
        packed, slocal = shape[:-1] + (shape[-1] // 2,), shape[:-1] + (shape[-1] // BLOCK,)
        wire_tscale = torch.empty(1, dtype=torch.float32, device=dev)
        tscale_entry = (wire_tscale, scalar_layout(layout, torch.float32))
        pairs = words(tensor) if tensor.dtype == torch.bfloat16 else None
        if pairs is not None:
            # The pack and copy boxes read the BF16 source in place and quantize it (data)
            # or compute its block scales (scale): no wire tensors, no extra pass.
            PATHS[("src", name)] = "fused"
            return Rewrite(entries={
                name + DATA_SUFFIX: (SentFromSource(tensor, pairs, cell, packed, int(_C.BOX_NV_DATA)), dlayout),
                name + SCALE_SUFFIX: (SentFromSource(tensor, pairs, cell, slocal, int(_C.BOX_NV_SCALE)), slayout),
                name + TSCALE_SUFFIX: tscale_entry},
                before=lambda: tensor_scale_into(cell, wire_tscale), prepass=amax)
        PATHS[("src", name)] = "staged"
        wire_data = torch.empty(packed, dtype=torch.uint8, device=dev)
        wire_scale = torch.empty(slocal, dtype=torch.uint8, device=dev)
        # BF16 pieces with flattenable rows are read in place; anything else goes through
        # a persistent BF16 copy (the cast rounds as Tensor.to does).
        stage = tensor if tensor.dtype == torch.bfloat16 and rows_view(tensor) else \
            torch.empty(shape, dtype=torch.bfloat16, device=dev)

        def before() -> None:
            if stage is not tensor:
                stage.copy_(tensor)
            if tensor.dtype != torch.bfloat16:
                as_bf16_amax(cell)
            quantize(stage, cell, wire_data, wire_scale, wire_tscale, "2d")

        return Rewrite(entries={name + DATA_SUFFIX: (wire_data, dlayout), name + SCALE_SUFFIX: (wire_scale, slayout),
                                name + TSCALE_SUFFIX: tscale_entry},
                       before=before, prepass=amax)

    # -- receiver side ------------------------------------------------------------------
    def rewrite_dst(self, name: str, target: Any, layout: Layout) -> Rewrite | None:
        if not self._select(name) or layout.error:
            return None
        if not (isinstance(target, (tuple, list)) and len(target) == 3
                and all(isinstance(t, torch.Tensor) for t in target)):
            raise ReshardError(f"NVFP4 converts {name!r}: its destination must be a (data, scale, tensor_scale) "
                               f"triple of tensors")
        data, scale, tscale = target
        dlayout = coarse_layout(name, layout, 2, torch.uint8)
        slayout = coarse_layout(name, layout, BLOCK, torch.uint8)
        # A data buffer of the layout's rank is the packed local shape (the planner checks
        # it against the layout); a flattened one needs this rank's piece.
        if data.dim() == len(layout.shape):
            local: tuple[int, ...] | None = tuple(data.shape[:-1]) + (2 * data.shape[-1],)
        else:
            local = layout.local_shape(self._rank())
        if local is None:
            raise ReshardError(f"NVFP4 converts {name!r}: this rank holds no piece of {layout!r}")
        self._check_buffers(name, data, scale, tscale, local)
        data_b, scale_b, tscale_f = data.view(torch.uint8), scale.view(torch.uint8), tscale.view(1)
        packed = local[:-1] + (local[-1] // 2,)

        if self.where == "receiver":
            staging = torch.empty(local, dtype=torch.bfloat16, device=data.device)
            cell = torch.zeros(1, dtype=torch.int32, device=data.device)  # the sources' amax lands here

            def after() -> None:
                quantize(staging, cell, data_b.view(-1), scale_b, tscale_f, self.scale_layout)

            return Rewrite(entries={name: (staging, layout.with_dtype(torch.bfloat16)),
                                    name + AMAX_SUFFIX: (cell, scalar_layout(layout, torch.int32))}, after=after)

        entries = {name + DATA_SUFFIX: (data_b.view(packed), dlayout),
                   name + TSCALE_SUFFIX: (tscale_f, scalar_layout(layout, torch.float32))}
        landing, after_landing = scales_landing(scale_b, local[:-1] + (local[-1] // BLOCK,), self.scale_layout)
        entries[name + SCALE_SUFFIX] = (landing, slayout)
        return Rewrite(entries=entries, after=after_landing)

    def _check_buffers(self, name: str, data: torch.Tensor, scale: torch.Tensor, tscale: torch.Tensor,
                       local: tuple[int, ...]) -> None:
        problems = []
        if local[-1] % BLOCK:
            problems.append(f"its local last dim {local[-1]} is not a multiple of {BLOCK}")
        else:
            want_data, want_scale = math.prod(local) // 2, scale_numel(local, self.scale_layout)
            if data.dtype not in _DATA_DTYPES or not data.is_contiguous() or data.numel() != want_data:
                problems.append(f"data must be a contiguous uint8 (or float4_e2m1fn_x2) tensor of {want_data} "
                                f"elements (local shape {local}, packed two per byte), got {data.dtype} "
                                f"{tuple(data.shape)}")
            if scale.dtype not in _SCALE_DTYPES or not scale.is_contiguous() or scale.numel() != want_scale:
                problems.append(f"scale ({self.scale_layout}) must be a contiguous float8_e4m3fn (or uint8) tensor "
                                f"of {want_scale} elements, got {scale.dtype} {tuple(scale.shape)}")
        if tscale.dtype != torch.float32 or tscale.numel() != 1:
            problems.append(f"tensor_scale must be one float32, got {tscale.dtype} {tuple(tscale.shape)}")
        if not data.device == scale.device == tscale.device:
            problems.append(f"data on {data.device}, scale on {scale.device}, tensor_scale on {tscale.device}")
        if problems:
            raise ReshardError(f"NVFP4 destination {name!r}: " + "; ".join(problems))


def wire_bytes_per_element(where: str) -> float:
    """Bytes on the wire per element of a converted tensor (the per-tensor float aside)."""
    return 2.0 if where == "receiver" else 0.5 + 1.0 / BLOCK


__all__ = ["NVFP4", "coarse_layout", "scalar_layout", "DATA_SUFFIX", "SCALE_SUFFIX", "TSCALE_SUFFIX", "AMAX_SUFFIX"]
