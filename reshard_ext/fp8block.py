"""rx.FP8Block: BF16/FP32 -> blockwise FP8 during a refit, and FP8 -> FP8 with its scales.

Blockwise FP8 is what engines load for DeepSeek-V3/R1, Kimi-K2 and the Qwen3 FP8
checkpoints: E4M3 data and one FP32 ``scale_inv`` per 128x128 block of the tensor's last
two dims (vLLM's ``weight`` + ``weight_scale_inv``; a leading dim, e.g. the experts of a
stacked ``[E, N, K]``, keeps each index's blocks apart: scale_inv ``[E, ceil(N/128),
ceil(K/128)]``). A converted destination is a pair of persistent buffers ``(data,
scale_inv)``: data ``float8_e4m3fn`` (or uint8) of the local shape, scale_inv float32 of the
local scale shape (its piece of the global grid), both contiguous. Blocks are those of the
*global* tensor; a partial last block (N or K not a multiple of 128) is quantized as the
references pad it (with zeros, which never raise an amax).

Conventions (``scales``), byte-identical to each reference (csrc/kernels/codecs/fp8block.h):
- ``"fp32"``: DeepSeek-V3's / DeepGEMM's ``per_block_cast_to_fp8``: amax over |x| in FP32
  (NaN propagates), clamped below at 1e-4; ``scale_inv = amax / 448``; data = the E4M3 cast
  of ``x * (448 / amax)`` (torch's rounding: 448 / amax as reciprocal(amax) * 448).
- ``"pow2"``: Transformer Engine's default for blockwise FP8 (``force_pow_2_scales=True``,
  amax epsilon 0): amax by fmaxf (NaN ignored); scale = 448 / amax truncated to a power of
  two (1 for an all-zero or Inf block, 2^127 where 448 / amax overflows); ``scale_inv = 1 /
  scale``; data = E4M3(x * scale), saturating.

Where the conversion runs (``where``):
- ``"sender"``: the wire carries ``name::fp8.data`` (E4M3) and ``name::fp8.scale`` (FP32
  scale_inv): 1 + 4/16384 bytes per element, 50.0% of BF16. Every execute starts with the
  amax pre-pass (reshard_ext/codecs/amax.py): each source rank takes the amax of its piece
  per global block; where source pieces cut blocks (TP shards of 64 rows, uneven shards)
  the source ranks of that tensor reduce their partial amaxes (MAX) before anything is
  quantized, so a cut block gets the global block's scale, never a per-shard one. Fused:
  the pack and copy boxes read the BF16/FP32 source in place and quantize with the block's
  factor (csrc/kernels/codecs/fp8block.h), for a source whose rows flatten, whose last dim
  has unit stride and whose pieces' last-dim boundaries (and K) are multiples of 16;
  otherwise each execute first quantizes the piece into a persistent wire tensor (staged).
  Sources whose pieces hold their blocks whole send their shard of the scales; where pieces
  cut blocks every source rank holds the whole grid after the reduction and the scales are
  a replicated tensor (the planner picks which replica sends each piece).
- ``"receiver"``: the logical tensor travels in the destination layout's dtype (BF16, or
  FP32), lands in a persistent staging tensor and is quantized there once it arrived
  (staged; a destination piece holds whole blocks, so its amaxes are local).

FP8 sources (data + scale_inv, e.g. Transformer Engine's Float8BlockwiseQTensor pieces,
quantized once on the trainer): pass ``(data, scale_inv)`` as the source tensor (the layout
describes the data, dtype float8_e4m3fn); data and scales move as they are, the scales
resharded over the block grid with their data (byte-identical to slicing the global FP8
tensors). Such a source needs ``where="sender"`` (its destination expects the pairs).

Every piece of a destination (and of an FP8 source) must hold its 128x128 blocks whole:
its scale_inv is then a slice of the global grid. A boundary that cuts a block raises
ReshardError at plan time on every rank, naming the tensor, the rank and the boundary.

``verify=True`` covers what the receiver holds: the E4M3 bytes and the FP32 scales on the
wire (sender-side, FP8 sources), or, receiver-side, the logical tensor the receiver
quantizes (its local quantize then is the deterministic kernel of both conventions).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .codecs import check_pair, rows_view
from .codecs.amax import AmaxPiece, block_grid
from .codecs.fp8block import (
    BLOCK,
    GRAIN,
    NAN,
    PATHS,
    SCALES,
    SOURCES,
    BlockScales,
    SentFromSource,
    block_of,
    gather_index,
    replicated_scale_layout,
    scale_layout,
    scale_shape,
)
from .errors import ReshardError
from .layout import Layout
from .transforms import Rewrite, Transform, name_selector

DATA_SUFFIX = "::fp8.data"
SCALE_SUFFIX = "::fp8.scale"

Params = Iterable[str] | Callable[[str], bool]


class FP8Block(Transform):
    """Converts the selected tensors to blockwise FP8 on the way (see the module doc).

    params: the dst names to convert: an iterable of names or a predicate name -> bool.
    block: (128, 128), the one block engines load.
    scales: "fp32" (DeepSeek-V3 / DeepGEMM) or "pow2" (Transformer Engine's default).
    where: "receiver" or "sender".
    group: the plan's process group (this rank's number in it; default WORLD).
    """

    def __init__(self, params: Params, block: tuple[int, int] = (BLOCK, BLOCK), scales: str = "fp32",
                 where: str = "receiver", group: Any = None):
        if tuple(block) != (BLOCK, BLOCK):
            raise ReshardError(f"FP8Block block must be ({BLOCK}, {BLOCK}), the block engines load; got {block!r}")
        if scales not in SCALES:
            raise ReshardError(f"FP8Block scales must be one of {sorted(SCALES)}, got {scales!r}")
        if where not in ("receiver", "sender"):
            raise ReshardError(f"FP8Block where must be 'receiver' or 'sender', got {where!r}")
        self._select, self._params_key = name_selector(params)
        self.scales, self.where, self.group = scales, where, group

    def cache_key(self) -> tuple:
        return (type(self).__name__, self._params_key, self.scales, self.where)

    def last_dim_grain(self, name: str) -> int | None:
        # The data wire, which the pack and copy boxes quantize 16 elements at a time.
        if self.where == "sender" and name.endswith(DATA_SUFFIX) and self._select(name[:-len(DATA_SUFFIX)]):
            return GRAIN
        return None

    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    # -- sender side ----------------------------------------------------------------------
    def rewrite_src(self, name: str, tensor: Any, layout: Layout) -> Rewrite | None:
        if not self._select(name) or layout.error:
            return None
        if isinstance(tensor, (tuple, list)):
            return self._fp8_source(name, tensor, layout)
        if self.where != "sender":
            return None  # the logical tensor travels; the receiver converts it
        if tensor.dtype not in SOURCES:
            raise ReshardError(f"FP8Block converts {name!r}: its source must be bfloat16 or float32, "
                               f"got {tensor.dtype}")
        if len(layout.shape) < 2 or tensor.dim() != len(layout.shape):
            if len(layout.shape) < 2:
                raise ReshardError(f"FP8Block converts {name!r}: blockwise FP8 quantizes tensors of two or more dims, "
                                   f"got shape {layout.shape}")
            return None  # a malformed entry: the planner reports it
        rank = self._rank()
        grid = block_grid(name, layout, block_of(len(layout.shape)))
        amax = AmaxPiece(name, layout, tensor, rank, block_of(len(layout.shape)), NAN[self.scales])
        scales = BlockScales(amax, self.scales)
        if grid.cut:  # every source rank holds the whole grid after the reduction
            slayout = replicated_scale_layout(layout)
            wire_scale = scales.scale_inv.view(scale_shape(layout.shape))
            index = None
        else:
            slayout = scale_layout(name, layout, "convert")
            index = gather_index(layout, rank).to(tensor.device)
            wire_scale = torch.empty(slayout.local_shape(rank) or (), dtype=torch.float32, device=tensor.device)
        if _fused(tensor, layout):
            PATHS[("src", name)] = "fused"
            data: Any = SentFromSource(tensor, scales)
            staged = None
        else:
            PATHS[("src", name)] = "staged"
            data = staged = torch.empty(tuple(tensor.shape), dtype=torch.float8_e4m3fn, device=tensor.device)

        def before() -> None:
            scales.update()
            if index is not None:
                torch.index_select(scales.scale_inv, 0, index, out=wire_scale.view(-1))
            if staged is not None:
                scales.quantize(staged.view(torch.uint8))

        return Rewrite(entries={name + DATA_SUFFIX: (data, layout.with_dtype(torch.float8_e4m3fn)),
                                name + SCALE_SUFFIX: (wire_scale, slayout)},
                       before=before, prepass=amax)

    def _fp8_source(self, name: str, pair: Any, layout: Layout) -> Rewrite:
        """An FP8 source (data, scale_inv): both move as they are."""
        if self.where != "sender":
            raise ReshardError(f"FP8Block: {name!r} has an FP8 source (data, scale_inv), which moves as pairs: use "
                               f"where='sender' (its destination then expects the pairs)")
        if not (len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
            raise ReshardError(f"FP8Block: the FP8 source of {name!r} must be a (data, scale_inv) pair of tensors")
        data, scale_inv = pair
        slayout = scale_layout(name, layout, "move the FP8 source of")
        rank = self._rank()
        local = layout.local_shape(rank)
        slocal = slayout.local_shape(rank)
        if local is None or slocal is None:
            raise ReshardError(f"FP8Block: rank {rank} passed an FP8 source of {name!r} but holds no piece of "
                               f"{layout!r}")
        check_pair(f"FP8Block source {name!r}", data, local, scale_inv, (torch.float32,), math.prod(slocal),
                   "scale_inv")
        PATHS[("src", name)] = "fp8"
        return Rewrite(entries={
            name + DATA_SUFFIX: (data.view(torch.float8_e4m3fn).view(local), layout.with_dtype(torch.float8_e4m3fn)),
            name + SCALE_SUFFIX: (scale_inv.view(slocal), slayout)})

    # -- receiver side --------------------------------------------------------------------
    def rewrite_dst(self, name: str, target: Any, layout: Layout) -> Rewrite | None:
        if not self._select(name) or layout.error:
            return None
        if not (isinstance(target, (tuple, list)) and len(target) == 2
                and all(isinstance(t, torch.Tensor) for t in target)):
            raise ReshardError(f"FP8Block converts {name!r}: its destination must be a (data, scale_inv) pair of "
                               f"tensors")
        data, scale_inv = target
        slayout = scale_layout(name, layout, "convert")
        rank = self._rank()
        local, slocal = layout.local_shape(rank), slayout.local_shape(rank)
        if local is None or slocal is None:
            raise ReshardError(f"FP8Block converts {name!r}: rank {rank} holds no piece of {layout!r}")
        check_pair(f"FP8Block destination {name!r}", data, local, scale_inv, (torch.float32,), math.prod(slocal),
                   "scale_inv")
        data_b, scale_f = data.view(torch.uint8).view(-1), scale_inv.view(torch.float32).view(slocal)
        if self.where == "sender":
            return Rewrite(entries={name + DATA_SUFFIX: (data.view(torch.float8_e4m3fn).view(local),
                                                         layout.with_dtype(torch.float8_e4m3fn)),
                                    name + SCALE_SUFFIX: (scale_f, slayout)})
        wire = layout.dtype if layout.dtype in SOURCES else torch.bfloat16
        PATHS[("dst", name)] = "staged"
        staging = torch.empty(local, dtype=wire, device=data.device)
        # a destination piece holds its blocks whole: its amaxes need no other rank
        scales = BlockScales(AmaxPiece(name, layout.with_dtype(wire), staging, rank, block_of(len(local)),
                                       NAN[self.scales]), self.scales)
        index = gather_index(layout, rank).to(data.device)

        def after() -> None:
            scales.amax.partial()
            scales.update()
            torch.index_select(scales.scale_inv, 0, index, out=scale_f.view(-1))
            scales.quantize(data_b)

        return Rewrite(entries={name: (staging, layout.with_dtype(wire))}, after=after)


def _fused(tensor: torch.Tensor, layout: Layout) -> bool:
    """Whether the pack and copy boxes can quantize the source piece in place: rows that
    flatten with unit stride along the last dim, and every piece's last-dim boundaries (K
    included) on the 16-element items of the boxes."""
    if rows_view(tensor) is None or (tensor.shape[-1] > 1 and tensor.stride(-1) != 1):
        return False
    k = layout.shape[-1]
    if k % GRAIN:
        return False
    for rank in set(layout.mesh.ranks):
        runs = layout.runs(rank)
        if runs is None or any(s % GRAIN or n % GRAIN for s, n in runs[-1]):
            return False
    return True


def wire_bytes_per_element(where: str) -> float:
    """Bytes on the wire per element of a converted BF16 tensor (whole blocks)."""
    return 2.0 if where == "receiver" else 1.0 + 4.0 / (BLOCK * BLOCK)


__all__ = ["FP8Block", "DATA_SUFFIX", "SCALE_SUFFIX", "wire_bytes_per_element"]
