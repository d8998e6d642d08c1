"""DTensor adapter: parameters that are DTensors (FSDP2, tensor parallel) -> plan entries.

A DTensor's device mesh is an N-d array of global ranks and its placements are one per
mesh dim, as in rx. ``Shard(d)`` maps to ``rx.Shard(d)`` (chunk semantics, as DTensor);
``_StridedShard(d, split_factor=s)`` (FSDP2 over a TP-sharded dim) maps to
``rx.Shard(d, stride=s)``: the dim is cut into s pieces, each split over the mesh dim,
so rank r holds chunks r, r+P, ..., exactly rx's strided shard. ``Partial`` has no
layout (the tensor is not materialised) and is refused.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from .. import groups
from ..errors import ReshardError
from ..layout import Layout, Mesh, Placement, Replicate, Shard
from . import Entries, named_tensors

try:  # private in torch; present since 2.4
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[assignment,misc]


def _placement(p: Any, name: str) -> Placement:
    if _StridedShard is not None and isinstance(p, _StridedShard):  # before Shard: it subclasses it
        return Shard(p.dim, stride=int(p.split_factor))
    if isinstance(p, DShard):
        return Shard(p.dim)
    if isinstance(p, DReplicate):
        return Replicate()
    raise ReshardError(f"DTensor '{name}': placement {p!r} has no layout (reduce it first)")


def _to_group(r: int, group: Any, rank_offset: int) -> int:
    if rank_offset:
        return r + rank_offset
    g = groups.group_rank(group, r)
    if g is None or g < 0:
        raise ReshardError(f"mesh rank {r} is not in the refit group")
    return g


def layout_of(t: DTensor, name: str = "<tensor>", *, group: Any = None, rank_offset: int = 0) -> Layout:
    ranks = t.device_mesh.mesh.tolist()

    def walk(x: Any) -> Any:
        return [walk(y) for y in x] if isinstance(x, list) else _to_group(int(x), group, rank_offset)

    placements = [_placement(p, name) for p in t.placements]
    return Layout(tuple(t.shape), t.dtype, Mesh(walk(ranks)), placements)


Source = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def entries(model: Source, *, group: Any = None, rank_offset: int = 0, buffers: bool = True) -> Entries:
    """Plan entries for every DTensor parameter (and DTensor persistent buffer) of `model`.

    `model` may also be a mapping or iterable of (name, DTensor). The local tensor is the
    DTensor's local shard (shared storage, so refits land in the parameter itself).
    """
    if isinstance(model, nn.Module):
        named: Iterable[tuple[str, torch.Tensor]] = (
            list(named_tensors(model)) if buffers else list(model.named_parameters()))
    elif isinstance(model, Mapping):
        named = model.items()
    else:
        named = model
    out: Entries = {}
    for name, t in named:
        data = t.data if isinstance(t, nn.Parameter) else t
        if not isinstance(data, DTensor):
            raise ReshardError(f"'{name}' is a plain {type(data).__name__}, not a DTensor")
        out[name] = (data.to_local(), layout_of(data, name, group=group, rank_offset=rank_offset))
    return out


__all__ = ["entries", "layout_of"]
