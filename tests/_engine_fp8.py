"""A block-FP8 inference engine layer with vLLM's conventions for DeepSeek-style FP8
checkpoints, for the FP8 engine-destination tests (written from vLLM's documented block
FP8 linear layers, not copied): E4M3 ``weight`` and FP32 ``weight_scale_inv`` per
128x128 block, both TP-sharded alike (a rank's rows of the weight and the matching rows
of block scales); ``gate_up_proj`` merges the gate and up outputs ([gate rows of rank r;
up rows of rank r], the scale rows likewise), ``down_proj`` is row parallel (columns and
scale columns split over TP).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

BLOCK = 128
E4M3 = torch.float8_e4m3fn


class BlockFP8Linear(nn.Module):
    """Merged column parallel (`outputs` = the logical outputs, each split over TP), or row
    parallel (`outputs` = [out], the input split over TP)."""

    def __init__(self, inp: int, outputs: list[int], rank: int, tp: int, row_parallel: bool = False,
                 whole_scales: bool = False):
        super().__init__()
        self.outputs, self.rank, self.tp, self.row, self.whole = outputs, rank, tp, row_parallel, whole_scales
        rows = sum(outputs) if row_parallel else sum(outputs) // tp
        cols = inp // tp if row_parallel else inp
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=E4M3), requires_grad=False)
        scale_cols = inp // BLOCK if whole_scales else cols // BLOCK
        self.weight_scale_inv = nn.Parameter(torch.empty(rows // BLOCK, scale_cols), requires_grad=False)

    def load(self, w: torch.Tensor, scale: bool, shard: int) -> None:
        param = self.weight_scale_inv if scale else self.weight
        unit = BLOCK if scale else 1
        if scale and self.whole:  # every rank keeps the whole scale grid (not its blocks' slice)
            param.data.copy_(w)
            return
        if self.row:
            size = param.shape[1]
            param.data.copy_(w.narrow(1, self.rank * size, size))
            return
        size = self.outputs[shard] // self.tp // unit
        offset = sum(self.outputs[:shard]) // self.tp // unit
        param.data.narrow(0, offset, size).copy_(w.narrow(0, self.rank * size, size))


class Engine(nn.Module):
    def __init__(self, rank: int, tp: int, hidden: int = 256, inter: int = 512, whole_scales: bool = False):
        super().__init__()
        self.gate_up_proj = BlockFP8Linear(hidden, [inter, inter], rank, tp)
        self.down_proj = BlockFP8Linear(inter, [hidden], rank, tp, row_parallel=True, whole_scales=whole_scales)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, w in weights:
            module, _, kind = name.removeprefix("mlp.").partition(".")
            scale = kind == "weight_scale_inv"
            if module in ("gate_proj", "up_proj"):
                self.gate_up_proj.load(w, scale, 0 if module == "gate_proj" else 1)
            else:
                self.down_proj.load(w, scale, 0)
            done.add(name)
        return done


def hf_shapes(hidden: int = 256, inter: int = 512) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The FP8 checkpoint's tensors (name -> (shape, dtype))."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
        out[f"mlp.{name}.weight"] = (shape, E4M3)
        out[f"mlp.{name}.weight_scale_inv"] = ((shape[0] // BLOCK, shape[1] // BLOCK), torch.float32)
    return out
