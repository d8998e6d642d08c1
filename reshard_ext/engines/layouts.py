"""Layout inference: the one rx.Layout under which every engine rank's piece of a Hugging
Face tensor is exactly what that rank's loader took (the ranks' pieces gathered first).

Ranks holding the same piece are replicas; the distinct pieces must form a grid over the
dims they split (one mesh dim per split dim, in dim order, plus one for replicas), and
each split dim must be one of: an even or torch.chunk split (Shard), an uneven split
(Shard(sizes=...): a padded vocabulary), a strided split (Shard(stride=...)) or packed
blocks (Shard(blocks=...)). The result is checked against every rank's piece.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch

from ..layout import Layout, Mesh, Placement, Replicate, Shard
from .boxes import Box


def _split_runs(length: int, parts: int, p: Shard) -> list[tuple[tuple[int, int], ...]] | None:
    """The runs each of `parts` coordinates takes from a dim of `length` under `p`."""
    layout = Layout((length,), torch.uint8, Mesh(list(range(parts))), [Shard(0, p.stride, p.blocks, p.sizes)])
    if layout.error:
        return None
    out = []
    for c in range(parts):
        runs = layout.runs(c)
        assert runs is not None  # c is in the mesh
        out.append(tuple((int(s), int(n)) for s, n in runs[0]))
    return out


def _placement(d: int, length: int, values: list[tuple[tuple[int, int], ...]]) -> Placement | None:
    """A Shard of dim `d` whose coordinates take `values` (ordered) from a dim of `length`."""
    k = len(values)
    candidates = [Shard(d)]
    if all(len(v) == 1 for v in values):
        candidates.append(Shard(d, sizes=tuple(v[0][1] for v in values)))
    m = len(values[0])
    if m > 1 and all(len(v) == m for v in values):
        candidates.append(Shard(d, stride=m))
        blocks = [values[-1][j][0] + values[-1][j][1] - values[0][j][0] for j in range(m)]
        candidates.append(Shard(d, blocks=tuple(blocks)))
    for p in candidates:
        if _split_runs(length, k, p) == values:
            return p
    return None


def infer(shape: tuple[int, ...], dtype: torch.dtype, pieces: Mapping[int, Box]) -> Layout | str:
    """The layout over the ranks of `pieces` (rank -> box) that gives each its box, or why
    there is none. Ranks must hold non-empty boxes."""
    classes: dict[Box, list[int]] = {}
    for rank in sorted(pieces):
        classes.setdefault(pieces[rank], []).append(rank)
    replicas = {len(r) for r in classes.values()}
    if len(replicas) != 1:
        counts = {box: len(r) for box, r in classes.items()}
        return f"ranks hold its pieces {sorted(counts.values())} times each: not a replicated grid"
    (m,) = replicas
    split = [d for d in range(len(shape)) if {box[d] for box in classes} != {((0, shape[d]),)}]
    values = {d: sorted({box[d] for box in classes}) for d in split}
    if len(classes) != math.prod(len(values[d]) for d in split):
        return f"its {len(classes)} distinct pieces do not form a grid over dims {split}"
    placements: list[Placement] = []
    for d in split:
        p = _placement(d, shape[d], values[d])
        if p is None:
            return f"the ranks' runs along dim {d}, {values[d]}, are no split rx.Shard describes"
        placements.append(p)
    grid = []
    for coord in itertools.product(*(range(len(values[d])) for d in split)):
        box = tuple(values[d][c] for d, c in zip(split, coord))
        ranks = next((r for b, r in classes.items() if tuple(b[d] for d in split) == box), None)
        if ranks is None:
            return f"no rank holds the piece {box} of dims {split}: not a grid"
        grid.extend(ranks)
    mesh_shape = [len(values[d]) for d in split]
    if m > 1 or not split:
        mesh_shape.append(m)
        placements.append(Replicate())
    layout = Layout(shape, dtype, Mesh(torch.tensor(grid).reshape(mesh_shape)), placements)
    if layout.error:
        return f"the inferred layout {layout!r} is invalid: {layout.error}"
    for rank, box in pieces.items():
        runs = layout.runs(rank)
        if runs is None or tuple(tuple(map(tuple, r)) for r in runs) != box:
            return f"the inferred layout {layout!r} does not give rank {rank} its piece {box}"
    return layout
