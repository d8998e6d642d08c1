"""The layout of a tensor derived from a quantized one along its last dim: packed data
(two FP4 values per byte) or block scales (one per block of the last dim).

Its last-dim placements are the source's divided by `per` (a Shard's packed blocks or
uneven sizes must be whole `block`s), and every rank's piece of it must be exactly what
the rank's piece of the source maps to (the C++ codec says which run of the coarse last
dim a run of the source covers), so that a piece quantized alone equals the logical
tensor's quantization. Rank-independent: sender and receiver derive the same layout.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layout import Layout, Shard


def coarse_layout_or_error(layout: Layout, cols: int, dtype: torch.dtype, per: int, block: int,
                           coarse_run: Callable[[Any], Any]) -> Layout | str:
    """The coarse layout (last dim of `cols`, elements of `dtype`) of `layout`, or why there is
    none. `coarse_run(run)`: the coarse run of a source's last-dim runs, or a reason (str)."""
    nd = len(layout.shape)
    if nd == 0:
        return "a 0-d tensor has no last dim to quantize along"
    last = nd - 1
    placements = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim % nd == last and p.blocks is not None:
            if any(b % block for b in p.blocks):
                return f"packed blocks {p.blocks} of the last dim are not multiples of {block}"
            p = Shard(p.dim, p.stride, tuple(b // per for b in p.blocks))
        if isinstance(p, Shard) and p.dim % nd == last and p.sizes is not None:
            if any(b % block for b in p.sizes):
                return f"shard sizes {p.sizes} of the last dim are not multiples of {block}"
            p = Shard(p.dim, sizes=tuple(b // per for b in p.sizes))
        placements.append(p)
    coarse = Layout(layout.shape[:-1] + (cols,), dtype, layout.mesh, placements)
    for rank in sorted(set(layout.mesh.ranks)):
        runs = layout.runs(rank)
        assert runs is not None  # rank is in the mesh
        crun = coarse_run(runs[-1])
        if isinstance(crun, str):
            return f"rank {rank}: {crun}"
        cruns = coarse.runs(rank) if not coarse.error else None
        if cruns is None or [list(map(tuple, r)) for r in cruns] != [list(map(tuple, r)) for r in runs[:-1]] + [crun]:
            return f"rank {rank}: its piece's blocks do not form a shard of the derived tensor"
    return coarse
