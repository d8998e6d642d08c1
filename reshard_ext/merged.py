"""Merged targets: one local tensor made of several logical tensors, as engines store them.

The merged local tensor is cut into views, one per component, and each view becomes a
plan entry ``(component_name, view, component_layout)``: the planner then moves boxes
straight from the components' source shards into the views (it reads strides and
data_ptr), and nothing is gathered on the source. A component's layout may have more
dims than the view's slab (e.g. QKV heads as ``[heads, head_dim, hidden]``): the slab
is reshaped to the layout's local shape, which must be possible without a copy.

- ``concat``: components back to back along a dim (vLLM qkv [q_r; k_r; v_r], gate_up
  [gate_r; up_r] from separate gate/up tensors).
- ``stack``: one component per index along a dim (stacked experts ``w13 [E, 2I, H]``,
  ``w2 [E, H, I]``, each index a per-expert tensor such as Megatron's ``weightK``).
- ``qkv_layouts`` / ``split_interleaved_qkv``: the q/k/v components of grouped-query
  attention on either side (vLLM's concatenated, Megatron's per-group interleaved).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .errors import ReshardError
from .layout import Layout, Mesh, Placement, Replicate, Shard

Entries = dict[str, tuple[torch.Tensor, Layout]]
Parts = Sequence[tuple[str, Layout]]


def _as_local(slab: torch.Tensor, name: str, layout: Layout, rank: int) -> torch.Tensor:
    want = layout.local_shape(rank)
    if want is None:
        raise ReshardError(f"merged component '{name}': rank {rank} is not in its mesh {layout.mesh}")
    try:
        return slab.view(want)
    except RuntimeError as e:
        raise ReshardError(f"merged component '{name}': slab {tuple(slab.shape)} cannot view as {want}: {e}") from None


def concat(local: torch.Tensor, dim: int, parts: Parts, rank: int) -> Entries:
    """Entries for `local` = this rank's pieces of `parts`, concatenated along `dim`."""
    out: Entries = {}
    offset = 0
    for name, layout in parts:
        want = layout.local_shape(rank)
        if want is None:
            raise ReshardError(f"merged component '{name}': rank {rank} is not in its mesh {layout.mesh}")
        rest = [s for d, s in enumerate(local.shape) if d != dim]
        numel = 1
        for s in want:
            numel *= s
        inner = 1
        for s in rest:
            inner *= s
        if inner == 0 or numel % inner:
            raise ReshardError(f"merged component '{name}': local shape {want} does not fit {tuple(local.shape)} "
                               f"along dim {dim}")
        length = numel // inner
        if offset + length > local.shape[dim]:
            raise ReshardError(f"merged components overflow dim {dim} of size {local.shape[dim]} at '{name}'")
        out[name] = (_as_local(local.narrow(dim, offset, length), name, layout, rank), layout)
        offset += length
    if offset != local.shape[dim]:
        raise ReshardError(f"merged components cover {offset} of {local.shape[dim]} along dim {dim}")
    return out


def stack(local: torch.Tensor, dim: int, parts: Parts, rank: int) -> Entries:
    """Entries for `local` whose index i along `dim` is this rank's piece of parts[i]."""
    if len(parts) != local.shape[dim]:
        raise ReshardError(f"{len(parts)} stacked components for a dim of size {local.shape[dim]}")
    return {name: (_as_local(local.select(dim, i), name, layout, rank), layout)
            for i, (name, layout) in enumerate(parts)}


def qkv_layouts(
    names: tuple[str, str, str],
    *,
    num_query_groups: int,
    heads_per_group: int,
    head_dim: int,
    hidden: int,
    dtype: torch.dtype,
    tp_ranks: Sequence[int],
) -> list[tuple[str, Layout]]:
    """Layouts of q ``[groups, heads_per_group, head_dim, hidden]`` and k, v
    ``[groups, head_dim, hidden]`` with heads split evenly over the TP ranks, in order.

    With fewer groups (KV heads) than ranks, each KV head is replicated on tp/groups
    consecutive ranks, which split that group's q heads (vLLM): a (groups, replicas)
    mesh with q on [Shard(0), Shard(1)] and k, v on [Shard(0), Replicate()]."""
    tp = len(tp_ranks)
    q_shape = (num_query_groups, heads_per_group, head_dim, hidden)
    kv_shape = (num_query_groups, head_dim, hidden)
    if num_query_groups >= tp:
        mesh = Mesh([list(tp_ranks)])
        q_place: list[Placement] = [Replicate(), Shard(0)]
        kv_place = q_place
    else:
        rep = tp // num_query_groups
        if tp % num_query_groups or heads_per_group % rep:
            raise ReshardError(f"{num_query_groups} KV heads x {heads_per_group} q heads do not split over TP {tp}")
        mesh = Mesh([list(tp_ranks[i * rep:(i + 1) * rep]) for i in range(num_query_groups)])
        q_place, kv_place = [Shard(0), Shard(1)], [Shard(0), Replicate()]
    q = Layout(q_shape, dtype, mesh, q_place)
    kv = Layout(kv_shape, dtype, mesh, kv_place)
    return [(names[0], q), (names[1], kv), (names[2], kv)]


def split_interleaved_qkv(
    entries: Mapping[str, tuple[torch.Tensor, Layout]],
    fused: str,
    names: tuple[str, str, str],
    *,
    num_query_groups: int,
    head_dim: int,
) -> Entries:
    """Replaces Megatron's fused ``linear_qkv.weight`` (or ``.bias``) entry (per query
    group [q heads; k; v], groups sharded over TP) by q/k/v entries that are strided views
    of the same local storage, with the shapes of `qkv_layouts` (a bias: without the
    trailing hidden dim)."""
    out = dict(entries)
    if fused not in out:
        return out
    local, layout = out.pop(fused)
    if len(layout.shape) not in (1, 2) or not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0 and p.stride == 1 and p.blocks is None)
        for p in layout.placements
    ):
        raise ReshardError(f"'{fused}': expected a 1-D or 2-D tensor plainly sharded on dim 0, got {layout!r}")
    rows, rest = layout.shape[0], tuple(layout.shape[1:])
    per_group = rows // num_query_groups
    heads_per_group = per_group // head_dim - 2
    if rows % num_query_groups or per_group % head_dim or heads_per_group < 1 or local.shape[0] % per_group:
        raise ReshardError(f"'{fused}': {rows} rows do not split into {num_query_groups} groups of head_dim {head_dim}")
    g = local.view(local.shape[0] // per_group, heads_per_group + 2, head_dim, *rest)
    views = (g[:, :heads_per_group], g[:, heads_per_group], g[:, heads_per_group + 1])
    shapes = (
        (num_query_groups, heads_per_group, head_dim, *rest),
        (num_query_groups, head_dim, *rest),
        (num_query_groups, head_dim, *rest),
    )
    for name, view, shape in zip(names, views, shapes):
        out[name] = (view, Layout(shape, layout.dtype, layout.mesh, layout.placements))
    return out


__all__ = ["concat", "stack", "qkv_layouts", "split_interleaved_qkv"]
