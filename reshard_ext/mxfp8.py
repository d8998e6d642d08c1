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
  tiles for ``"swizzled"`` (csrc/kernels/api.h, RX_BOX_MX_DATA). The boxes never write
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
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _C
from .errors import ReshardError
from .layout import Layout, Shard, code_of
from .transforms import Piece, Rewrite, Transform

DATA_SUFFIX = "::mx.data"
SCALE_SUFFIX = "::mx.scale"
BLOCK = int(_C.MX_BLOCK)

_SCALE_LAYOUTS = {"2d": int(_C.MX_SCALE_2D), "swizzled": int(_C.MX_SCALE_SWIZZLED)}
_ROUNDINGS = {"ceil": int(_C.MX_ROUND_CEIL), "floor": int(_C.MX_ROUND_FLOOR)}
_SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)
_DATA_DTYPES = (torch.float8_e4m3fn, torch.uint8)


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


def _rows_view(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, cols, row_stride) when t is [..., K] with unit last stride and leading dims
    that flatten to one stride; None otherwise."""
    if t.dim() == 0:
        return None
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    if cols > 1 and t.stride(-1) != 1:
        return None
    if t.dim() == 1 or rows <= 1:
        return rows, cols, max(cols, 1)
    lead = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    row_stride = lead[-1][1]
    expect = row_stride
    for s, st in reversed(lead):
        if st != expect:
            return None
        expect = st * s
    return rows, cols, row_stride


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def quantize(src: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
             scale_layout: str = "2d", rounding: str = "ceil") -> None:
    """Quantizes BF16 `src` [..., K] into contiguous `data` (E4M3 bytes, same numel) and
    `scale` (E8M0 bytes), on src's device (CUDA: on the current stream)."""
    if src.dtype != torch.bfloat16:
        raise ReshardError(f"MXFP8 quantize: source must be bfloat16, got {src.dtype}")
    view = _rows_view(src)
    if view is None:
        src = src.contiguous()
        view = _rows_view(src)
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
            _SCALE_LAYOUTS[scale_layout], _ROUNDINGS[rounding])
    if src.is_cuda:
        if not hasattr(_C, "mxfp8_quantize_cuda"):
            raise ReshardError("MXFP8 on CUDA tensors needs reshard_ext built with CUDA")
        _C.mxfp8_quantize_cuda(*args, _stream(src))
    else:
        _C.mxfp8_quantize_cpu(*args)


def swizzle(scale2d: torch.Tensor, out: torch.Tensor) -> None:
    """Rewrites a contiguous [rows, scols] scale matrix into the swizzled layout `out`."""
    rows, scols = math.prod(scale2d.shape[:-1]), scale2d.shape[-1]
    if not (scale2d.is_contiguous() and out.is_contiguous() and out.numel() == swizzled_size(rows, scols)):
        raise ReshardError("MXFP8 swizzle: contiguous [rows, scols] input and a swizzled-size output required")
    if scale2d.is_cuda:
        _C.mxfp8_swizzle_cuda(scale2d.data_ptr(), rows, scols, out.data_ptr(), _stream(scale2d))
    else:
        _C.mxfp8_swizzle_cpu(scale2d.data_ptr(), rows, scols, out.data_ptr())


# ---- layouts of the wire tensors ---------------------------------------------------

def data_layout(layout: Layout) -> Layout:
    return layout.with_dtype(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=4096)
def _scale_layout_or_error(layout: Layout) -> Layout | str:
    """The uint8 layout of the scales of `layout`'s data, checked on every rank of the
    mesh (rank-independent, so sender and receiver agree), or why there is none."""
    nd = len(layout.shape)
    if nd == 0:
        return "a 0-d tensor has no last dim to quantize along"
    last, k = nd - 1, layout.shape[-1]
    placements = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim % nd == last and p.blocks is not None:
            if any(b % BLOCK for b in p.blocks):
                return f"packed blocks {p.blocks} of the last dim are not multiples of {BLOCK}"
            p = Shard(p.dim, p.stride, tuple(b // BLOCK for b in p.blocks))
        placements.append(p)
    scale = Layout(layout.shape[:-1] + (scale_cols(k),), torch.uint8, layout.mesh, placements)
    for rank in sorted(set(layout.mesh.ranks)):
        runs = layout.runs(rank)
        assert runs is not None  # rank is in the mesh
        srun = _C.mxfp8_scale_runs(runs[-1], k)
        if isinstance(srun, str):
            return f"rank {rank}: {srun}"
        sruns = scale.runs(rank) if not scale.error else None
        if sruns is None or [list(map(tuple, r)) for r in sruns] != [list(map(tuple, r)) for r in runs[:-1]] + [srun]:
            return f"rank {rank}: the scale blocks of its piece do not form a shard of the scale tensor"
    return scale


def scale_layout(name: str, layout: Layout) -> Layout:
    """The uint8 scale layout of `name`'s data, or ReshardError naming the tensor."""
    got = _scale_layout_or_error(layout)
    if isinstance(got, str):
        raise ReshardError(
            f"MXFP8 cannot convert {name!r} with layout {layout!r}: {got}; quantizing that piece "
            f"alone would differ from quantizing the logical tensor (shard the last dim in whole "
            f"{BLOCK}-element blocks)")
    return got


# ---- pieces that quantize inside the box kernels --------------------------------------

# How each converted piece of this process was last bound: (side, name) -> "fused"
# (quantized inside the pack/unpack/copy boxes) or "staged" (a BF16 staging or wire
# tensor plus a separate quantize pass). For tests and diagnostics.
PATHS: dict[tuple[str, str], str] = {}


def _mode(kind: int, rounding: str, layout: str = "2d") -> int:
    """rx_box.mode (csrc/kernels/api.h): kind | rounding << 8 | scale layout << 16."""
    return kind | _ROUNDINGS[rounding] << 8 | _SCALE_LAYOUTS[layout] << 16


def _zero_swizzled_padding(scale: torch.Tensor, rows: int, scols: int) -> None:
    """Zeroes the padding bytes of a swizzled scale buffer and leaves its scales alone:
    binding a plan must not disturb scales an engine may still read before the refit.
    The fused boxes write only the scales of real blocks, so this, once per bind, is
    what keeps the padding 0."""
    real = torch.ones((rows, scols), dtype=torch.uint8, device=scale.device)
    where = torch.empty_like(scale)
    swizzle(real, where)  # 1 at every real scale, 0 in the padding
    scale.masked_fill_(where == 0, 0)


class _ReceivedData(Piece):
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

    def ref(self, whole: bool) -> tuple:
        PATHS[("dst", self.name)] = "fused" if whole else "staged"
        if whole:
            self.staging = None
            cols = self.shape[-1]
            if self.scale_layout == "swizzled":
                _zero_swizzled_padding(self.scale, math.prod(self.shape[:-1]), scale_cols(cols))
            return (self.data.data_ptr(), list(self.data.stride()), code_of(self.data.dtype),
                    _mode(int(_C.BOX_MX_DATA), self.rounding, self.scale_layout), self.scale.data_ptr(), cols)
        if self.staging is None:
            self.staging = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
        return (self.staging.data_ptr(), list(self.staging.stride()), code_of(torch.bfloat16))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.given, self.scale)

    def after(self) -> None:
        if self.staging is not None:
            quantize(self.staging, self.data.view(-1), self.scale, self.scale_layout, self.rounding)


class _SentFromSource(Piece):
    """A wire tensor (`name::mx.data` or `name::mx.scale`) that is never materialized:
    the pack and copy boxes read the BF16 source piece in place and quantize it (data)
    or compute its block scales (scale) on the way."""

    def __init__(self, source: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, kind: int, rounding: str):
        super().__init__(shape, dtype, source.device)
        self.source, self.mode = source, _mode(kind, rounding)

    def ref(self, whole: bool) -> tuple:
        return (self.source.data_ptr(), list(self.source.stride()), code_of(torch.bfloat16), self.mode, 0)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.source,)


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
        if scale_layout not in _SCALE_LAYOUTS:
            raise ReshardError(f"MXFP8 scale_layout must be one of {sorted(_SCALE_LAYOUTS)}, got {scale_layout!r}")
        if where not in ("receiver", "sender"):
            raise ReshardError(f"MXFP8 where must be 'receiver' or 'sender', got {where!r}")
        if rounding not in _ROUNDINGS:
            raise ReshardError(f"MXFP8 rounding must be one of {sorted(_ROUNDINGS)}, got {rounding!r}")
        if callable(params):
            self._select: Callable[[str], bool] = params
            self._params_key: Any = ("callable", id(params))
        else:
            names = frozenset(params)
            self._select = names.__contains__
            self._params_key = names
        self.scale_layout = scale_layout
        self.where = where
        self.rounding = rounding
        self.group = group

    def cache_key(self) -> tuple:
        return (type(self).__name__, self._params_key, self.scale_layout, self.where, self.rounding)

    def receiver_mx_rounding(self, name: str) -> int | None:
        return _ROUNDINGS[self.rounding] if self.where == "receiver" and self._select(name) else None

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

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
                name + DATA_SUFFIX: (_SentFromSource(tensor, shape, torch.float8_e4m3fn, int(_C.BOX_MX_DATA),
                                                     self.rounding), data_layout(layout)),
                name + SCALE_SUFFIX: (_SentFromSource(tensor, slocal, torch.uint8, int(_C.BOX_MX_SCALE), self.rounding),
                                      slayout)})
        PATHS[("src", name)] = "staged"
        wire_data = torch.empty(shape, dtype=torch.float8_e4m3fn, device=tensor.device)
        wire_scale = torch.empty(slocal, dtype=torch.uint8, device=tensor.device)
        # BF16 pieces with flattenable rows are read in place; anything else goes through
        # a persistent BF16 copy (the cast rounds as Tensor.to does).
        stage = tensor if tensor.dtype == torch.bfloat16 and _rows_view(tensor) else \
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
            piece = _ReceivedData(name, data_b, scale_b, local, self.scale_layout, self.rounding)
            return Rewrite(entries={name: (piece, layout.with_dtype(torch.bfloat16))}, after=piece.after)
        if self.where == "receiver":
            PATHS[("dst", name)] = "staged"
            staging = torch.empty(local, dtype=torch.bfloat16, device=data.device)

            def after() -> None:
                quantize(staging, data_b, scale_b, self.scale_layout, self.rounding)

            return Rewrite(entries={name: (staging, layout.with_dtype(torch.bfloat16))}, after=after)

        entries = {name + DATA_SUFFIX: (data.view(torch.float8_e4m3fn).view(local), data_layout(layout))}
        slocal = local[:-1] + (scale_cols(local[-1]),)
        if self.scale_layout == "2d":
            entries[name + SCALE_SUFFIX] = (scale_b.view(slocal), slayout)
            return Rewrite(entries=entries)
        scale2d = torch.empty(slocal, dtype=torch.uint8, device=scale.device)
        entries[name + SCALE_SUFFIX] = (scale2d, slayout)

        def after_swizzle() -> None:
            swizzle(scale2d, scale_b)

        return Rewrite(entries=entries, after=after_swizzle)

    def _check_buffers(self, name: str, data: torch.Tensor, scale: torch.Tensor, local: tuple[int, ...]) -> None:
        want_scale = scale_numel(local, self.scale_layout)
        problems = []
        if data.dtype not in _DATA_DTYPES or not data.is_contiguous() or data.numel() != math.prod(local):
            problems.append(f"data must be a contiguous float8_e4m3fn (or uint8) tensor of {math.prod(local)} "
                            f"elements (local shape {local}), got {data.dtype} {tuple(data.shape)}")
        if scale.dtype not in _SCALE_DTYPES or not scale.is_contiguous() or scale.numel() != want_scale:
            problems.append(f"scale ({self.scale_layout}) must be a contiguous uint8 (or float8_e8m0fnu) tensor "
                            f"of {want_scale} elements, got {scale.dtype} {tuple(scale.shape)}")
        if data.device != scale.device:
            problems.append(f"data on {data.device} but scale on {scale.device}")
        if problems:
            raise ReshardError(f"MXFP8 destination {name!r}: " + "; ".join(problems))


def wire_bytes_per_element(where: str) -> float:
    """Bytes on the wire per element of a converted tensor."""
    return 2.0 if where == "receiver" else 1.0 + 1.0 / BLOCK


__all__ = ["MXFP8", "quantize", "swizzle", "scale_layout", "data_layout", "scale_numel",
           "swizzled_size", "DATA_SUFFIX", "SCALE_SUFFIX"]
