"""Views of a logical tensor, applied to a rank's piece and to its layout at once.

A view op (narrow, select, squeeze, transpose, split of a dim) turns a logical tensor
into another logical tensor whose elements are some of the first one's. Applied to a
plan entry ``(piece, layout)`` it gives the entry of the viewed tensor: the layout of
the view (rank-independent, so every rank derives the same one) and this rank's piece
of it, a view of the same storage (never a copy), or None where this rank holds none of
the view. Adapters use them to describe a parameter under other names and shapes, e.g.
one expert of a stacked ``[E, 2I, H]`` parameter, its gate half, or a ``q_proj`` of
``num_heads * head_dim`` rows as ``[groups, heads_per_group, head_dim, hidden]``.

Sharded dims are handled where the view stays a layout: a narrow of a dim split evenly
over one mesh dim (whole chunks, within one chunk, or across chunks, where each rank
keeps its share as an uneven ``Shard(sizes=...)``: the real rows of a padded
vocabulary), a split of a dim whose shards fall on the new dims' boundaries. Anything else (an uneven, strided or packed
shard in the way) raises a ReshardError that names the tensor and the layout.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .errors import ReshardError
from .layout import Layout, Mesh, Placement, Replicate, Shard

Piece = torch.Tensor | None


def _sharding(layout: Layout, dim: int) -> list[int]:
    """Mesh dims whose placement shards tensor dim `dim`, in mesh order."""
    return [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim]


def _plain(layout: Layout, mesh_dim: int, dim: int, name: str, what: str) -> int:
    """The even chunk length of `dim` over mesh dim `mesh_dim` (a plain Shard)."""
    p = layout.placements[mesh_dim]
    size = layout.mesh.shape[mesh_dim]
    assert isinstance(p, Shard)
    if p.stride != 1 or p.blocks is not None or p.sizes is not None or layout.shape[dim] % size:
        raise ReshardError(f"'{name}': cannot take {what} of dim {dim}, sharded as {p!r} over {size} ranks "
                           f"({layout!r}): only even plain shards can be viewed")
    return layout.shape[dim] // size


def _mesh_slice(mesh: Mesh, mesh_dim: int, start: int, length: int) -> Mesh:
    ranks = torch.tensor(mesh.ranks, dtype=torch.int64).reshape(mesh.shape)
    return Mesh(ranks.narrow(mesh_dim, start, length).tolist())


def _coordinate(mesh: Mesh, rank: int, mesh_dim: int) -> int:
    """`rank`'s index along `mesh_dim` of `mesh`."""
    index = mesh.ranks.index(rank)
    for size in reversed(mesh.shape[mesh_dim + 1:]):
        index //= size
    return index % mesh.shape[mesh_dim]


def _held(piece: Piece, layout: Layout, rank: int) -> Piece:
    return piece if rank in layout.mesh else None


def narrow(piece: Piece, layout: Layout, rank: int, dim: int, start: int, length: int,
           name: str = "<tensor>") -> tuple[Piece, Layout]:
    """Elements ``start .. start+length-1`` of `dim` (``Tensor.narrow``)."""
    dim = _dim(dim, layout, name)
    if not (0 <= start and length >= 0 and start + length <= layout.shape[dim]):
        raise ReshardError(f"'{name}': narrow({dim}, {start}, {length}) outside its shape {layout.shape}")
    shape = list(layout.shape)
    shape[dim] = length
    mesh, placements = layout.mesh, list(layout.placements)
    sharding = _sharding(layout, dim)
    if len(sharding) > 1:
        raise ReshardError(f"'{name}': cannot narrow dim {dim}, sharded over several mesh dims ({layout!r})")
    local_start = start
    if sharding:
        m = sharding[0]
        chunk = _plain(layout, m, dim, name, f"narrow({start}, {length})")
        if start % chunk == 0 and length % chunk == 0 and length:  # whole chunks: the ranks that hold them
            mesh = _mesh_slice(mesh, m, start // chunk, length // chunk)
            local_start = 0
        elif length and start // chunk == (start + length - 1) // chunk:  # inside one chunk: one rank's part
            k = start // chunk
            mesh = _mesh_slice(mesh, m, k, 1)
            placements[m] = Replicate()
            local_start = start - k * chunk
        else:  # across chunks: each rank keeps its share, an uneven split (a padded vocabulary's real rows)
            ends = [min(max(start + length - c * chunk, 0), chunk) for c in range(layout.mesh.shape[m])]
            begins = [min(max(start - c * chunk, 0), chunk) for c in range(layout.mesh.shape[m])]
            placements[m] = Shard(dim, sizes=tuple(e - b for b, e in zip(begins, ends)))
            if rank in mesh:
                local_start = begins[_coordinate(mesh, rank, m)]
    out = Layout(shape, layout.dtype, mesh, placements)
    if piece is None or rank not in mesh:
        return None, out
    lengths = out.local_shape(rank)
    assert lengths is not None
    return piece.narrow(dim, local_start, lengths[dim]), out


def squeeze(piece: Piece, layout: Layout, rank: int, dim: int, name: str = "<tensor>") -> tuple[Piece, Layout]:
    """Drops `dim`, of size 1 (``Tensor.squeeze(dim)``)."""
    dim = _dim(dim, layout, name)
    if layout.shape[dim] != 1:
        raise ReshardError(f"'{name}': cannot squeeze dim {dim} of size {layout.shape[dim]}")
    placements: list[Placement] = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim == dim:
            placements.append(Replicate())  # one element: every rank of that mesh dim holds it all or none
        elif isinstance(p, Shard) and p.dim > dim:
            placements.append(dataclasses.replace(p, dim=p.dim - 1))
        else:
            placements.append(p)
    out = Layout(layout.shape[:dim] + layout.shape[dim + 1:], layout.dtype, layout.mesh, placements)
    held = _held(piece, out, rank)
    return (None if held is None else held.squeeze(dim)), out


def select(piece: Piece, layout: Layout, rank: int, dim: int, index: int,
           name: str = "<tensor>") -> tuple[Piece, Layout]:
    """Index `index` of `dim`, which goes away (``Tensor.select``)."""
    piece, layout = narrow(piece, layout, rank, dim, index, 1, name)
    return squeeze(piece, layout, rank, dim, name)


def transpose(piece: Piece, layout: Layout, rank: int, dim0: int, dim1: int,
              name: str = "<tensor>") -> tuple[Piece, Layout]:
    """Swaps two dims (``Tensor.transpose``)."""
    d0, d1 = _dim(dim0, layout, name), _dim(dim1, layout, name)
    swap = {d0: d1, d1: d0}
    shape = list(layout.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    placements = [dataclasses.replace(p, dim=swap.get(p.dim, p.dim)) if isinstance(p, Shard) else p
                  for p in layout.placements]
    out = Layout(shape, layout.dtype, layout.mesh, placements)
    held = _held(piece, out, rank)
    return (None if held is None else held.transpose(d0, d1)), out


def split_dim(piece: Piece, layout: Layout, rank: int, dim: int, sizes: Sequence[int],
              name: str = "<tensor>") -> tuple[Piece, Layout]:
    """Replaces `dim` by dims of `sizes` (their product), row-major, as ``Tensor.unflatten``.

    Each mesh dim that shards `dim` must cut it on the new dims' boundaries: it then
    shards the new dims it spans (a mesh dim spanning several becomes several mesh dims,
    e.g. 4 ranks over (2 groups, 4 heads) become a 2 x 2 mesh sharding both)."""
    dim = _dim(dim, layout, name)
    sizes = [int(s) for s in sizes]
    total = 1
    for s in sizes:
        total *= s
    if total != layout.shape[dim] or not sizes:
        raise ReshardError(f"'{name}': cannot split dim {dim} of size {layout.shape[dim]} into {sizes}")
    extra = len(sizes) - 1
    left = list(sizes)  # what each new dim still has to split
    cur = 0
    mesh_shape: list[int] = []
    placements: list[Placement] = []
    for m, p in enumerate(layout.placements):
        n = layout.mesh.shape[m]
        if not (isinstance(p, Shard) and p.dim == dim):
            mesh_shape.append(n)
            placements.append(dataclasses.replace(p, dim=p.dim + extra) if isinstance(p, Shard) and p.dim > dim else p)
            continue
        _plain(layout, m, dim, name, f"a split into {sizes}")
        factors: list[tuple[int, int]] = []  # (new dim, ranks along it)
        ways = n
        while ways > 1:
            while cur < len(left) and left[cur] == 1:
                cur += 1
            if cur == len(left):
                raise ReshardError(f"'{name}': {n} shards of dim {dim} do not fit its split into {sizes} ({layout!r})")
            if left[cur] % ways == 0:
                factors.append((cur, ways))
                left[cur] //= ways
                ways = 1
            elif ways % left[cur] == 0:
                factors.append((cur, left[cur]))
                ways //= left[cur]
                left[cur] = 1
            else:
                raise ReshardError(f"'{name}': {n} shards of dim {dim} cut its split into {sizes} off the "
                                   f"boundaries ({layout!r})")
        if not factors:  # a mesh dim of one rank
            mesh_shape.append(n)
            placements.append(Replicate())
        for d, ways in factors:
            mesh_shape.append(ways)
            placements.append(Shard(dim + d))
    shape = list(layout.shape[:dim]) + sizes + list(layout.shape[dim + 1:])
    mesh = Mesh(torch.tensor(layout.mesh.ranks, dtype=torch.int64).reshape(mesh_shape).tolist())
    out = Layout(shape, layout.dtype, mesh, placements)
    if piece is None or rank not in mesh:
        return None, out
    want = out.local_shape(rank)
    assert want is not None
    try:
        return piece.view(want), out
    except RuntimeError as e:
        raise ReshardError(f"'{name}': its piece {tuple(piece.shape)} cannot view as {want}: {e}") from None


def _dim(dim: int, layout: Layout, name: str) -> int:
    n = len(layout.shape)
    if not -n <= dim < n:
        raise ReshardError(f"'{name}': dim {dim} out of range for shape {layout.shape}")
    return dim % n


__all__ = ["narrow", "select", "squeeze", "transpose", "split_dim"]
