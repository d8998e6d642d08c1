"""Megatron-Core adapter: ``{global_name: (local_tensor, Layout)}`` from a model.

Everything is read from the model itself, as Megatron-Core stamps it:
- parameters: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` and
  ``partition_sizes`` (per-rank block sizes of packed parameters);
- experts: ``allreduce=False``; per-expert names ``...weightK`` / ``...biasK`` (grouped
  GEMM) or ``...local_experts.K...`` (sequential) are renamed to global expert indices
  ``ep_rank * local_experts + K``; they are sharded over ``expt_tp`` and replicated over
  ``expt_dp``;
- ``layer_number`` (1-based, global) of layer modules renames stage-local
  ``decoder.layers.i`` to global indices (PP and virtual PP: pass the chunk list);
- persistent buffers (router ``expert_bias``...) travel with the weights, replicated;
- tied embeddings: a source model sharing embeddings and output weights and holding
  no ``output_layer.weight`` offers the word embeddings under that name too;
- multi-token prediction (``mtp_num_layers``) at PP > 1: the MTP stage holds a copy of
  the word embeddings that Megatron keeps equal to the first stage's (its gradients are
  all-reduced over ``pg_collection.embd``), so ``embedding.word_embeddings.weight`` is
  one tensor replicated over the stages of that group, and a refit writes every copy;
- process groups from ``model.pg_collection`` (tp, dp or dp_cp, ep, expt_tp, expt_dp).

Meshes: a dense tensor lives on the (replica x tp) grid of its stage. Each rank builds
the grid from its own groups assuming Megatron's rank order, where the grid is a
translate of the groups through this rank (rank(i, j) = dp[i] + tp[j] - me); if custom
groups break that, ranks disagree on the layout and ``plan`` raises on every rank.
Mesh ranks are ranks of the refit ``group``: model ranks plus ``rank_offset`` (models
living in another world), else the model rank's rank in ``group``.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from .. import groups as process_groups
from ..errors import ReshardError
from ..layout import Layout, Mesh, Replicate, Shard
from . import Entries, named_tensors

_EXPERT_INDEX = (
    re.compile(r"^(.*\.)?(weight|bias)(\d+)$"),  # TEGroupedMLP: experts.linear_fc1.weight3
    re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$"),  # SequentialMLP: experts.local_experts.3.linear_fc1.weight
)
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"

Model = nn.Module | Sequence[nn.Module]


def unwrap(module: nn.Module) -> nn.Module:
    """Strips DDP / Float16Module-style wrappers (their parameters live under `.module`)."""
    while isinstance(inner := getattr(module, "module", None), nn.Module):
        module = inner
    return module


def _pg_ranks(pg: Any) -> list[int]:
    """Ranks of a group in the model's own world (a seam for models in other worlds)."""
    return list(process_groups.ranks(pg))


class _Groups:
    """The model's groups, as rank lists translated into refit-group ranks."""

    def __init__(self, pg_collection: Any, group: Any, rank_offset: int):
        self.pgc = pg_collection
        self.group = group
        self.offset = rank_offset
        tp = getattr(pg_collection, "tp", None)
        self.me = _pg_ranks(tp)[process_groups.rank(tp)] if tp is not None else process_groups.rank()

    def ranks(self, *attrs: str) -> list[int]:
        """Model-world ranks of the first of `attrs` that the collection has; [me] if none."""
        for attr in attrs:
            pg = getattr(self.pgc, attr, None)
            if pg is not None:
                ranks = _pg_ranks(pg)
                if self.me not in ranks:
                    raise ReshardError(f"pg_collection.{attr} {ranks} does not contain this rank {self.me}")
                return ranks
        return [self.me]

    def rank_in(self, attr: str) -> int:
        pg = getattr(self.pgc, attr, None)
        return 0 if pg is None else process_groups.rank(pg)

    def to_group(self, r: int) -> int:
        if self.offset:
            return r + self.offset
        g = process_groups.group_rank(self.group, r)
        if g is None or g < 0:
            raise ReshardError(f"model rank {r} is not in the refit group")
        return g

    def grid(self, replicas: list[int], tp: list[int]) -> Mesh:
        return Mesh([[self.to_group(r + t - self.me) for t in tp] for r in replicas])

    def across(self, attr: str, replicas: list[int]) -> list[int]:
        """`replicas` of this stage and their translates on every stage of group `attr`."""
        return [s + r - self.me for s in self.ranks(attr) for r in replicas]


def _layer_prefixes(module: nn.Module) -> dict[str, str]:
    """Stage-local layer module path -> global path, from each layer's 1-based layer_number."""
    out = {}
    for path, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        parts = path.split(".")
        if isinstance(number, int) and parts[-1].isdigit():
            out[path] = ".".join(parts[:-1] + [str(number - 1)])
    return out


def _global_layer_name(name: str, prefixes: dict[str, str]) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # longest module prefix wins
        mapped = prefixes.get(".".join(parts[:i]))
        if mapped is not None:
            return ".".join([mapped] + parts[i:])
    return name


def _expert_slot(name: str) -> tuple[str, int] | None:
    """(name with the local expert index replaced by '{}', local index), or None."""
    m = _EXPERT_INDEX[0].match(name)
    if m:
        return f"{m.group(1) or ''}{m.group(2)}{{}}", int(m.group(3))
    m = _EXPERT_INDEX[1].match(name)
    if m:
        return f"{m.group(1)}{{}}{m.group(3)}", int(m.group(2))
    return None


def _layout(tensor: torch.Tensor, name: str, mesh: Mesh, tp_size: int) -> Layout:
    shape = list(tensor.shape)
    if not getattr(tensor, "tensor_model_parallel", False):
        return Layout(shape, tensor.dtype, mesh, [Replicate(), Replicate()])
    dim = int(getattr(tensor, "partition_dim", 0))
    stride = int(getattr(tensor, "partition_stride", 1))
    sizes = getattr(tensor, "partition_sizes", None)
    if not 0 <= dim < len(shape):
        raise ReshardError(f"'{name}': partition_dim {dim} out of range for local shape {tuple(shape)}")
    blocks = None
    if sizes is not None:
        if sum(sizes) != shape[dim]:
            raise ReshardError(f"'{name}': partition_sizes {list(sizes)} do not add up to local dim {shape[dim]}")
        blocks = tuple(int(s) * tp_size for s in sizes)
    shape[dim] *= tp_size
    return Layout(shape, tensor.dtype, mesh, [Replicate(), Shard(dim, stride, blocks)])


def _chunk_entries(core: nn.Module, groups: _Groups, num_experts: int | None, mtp: bool) -> Entries:
    prefixes = _layer_prefixes(core)
    tensors = [(_global_layer_name(n, prefixes), t) for n, t in named_tensors(core)]

    tp = groups.ranks("tp")
    replicas = groups.ranks("dp_cp", "dp")
    dense_mesh = groups.grid(replicas, tp)
    # MTP: the first stage's embeddings and the MTP stage's copy are one tensor
    embedding_mesh = groups.grid(groups.across("embd", replicas), tp) if mtp else dense_mesh
    expt_tp = groups.ranks("expt_tp", "tp")
    expert_mesh = groups.grid(groups.ranks("expt_dp"), expt_tp)
    ep_size, ep_rank = len(groups.ranks("ep")), groups.rank_in("ep")

    # Local experts per slot (e.g. 'decoder.layers.3.mlp.experts.linear_fc1.weight{}').
    local_counts: dict[str, int] = defaultdict(int)
    for name, t in tensors:
        slot = _expert_slot(name) if getattr(t, "allreduce", True) is False else None
        if slot:
            local_counts[slot[0]] = max(local_counts[slot[0]], slot[1] + 1)

    out: Entries = {}
    for name, t in tensors:
        if getattr(t, "allreduce", True) is False:
            slot = _expert_slot(name)
            if slot is not None:
                per_rank = local_counts[slot[0]]
                if num_experts is not None:
                    if num_experts % ep_size or num_experts // ep_size < per_rank:
                        raise ReshardError(f"'{name}': {num_experts} experts over EP {ep_size}, {per_rank} held here")
                    per_rank = num_experts // ep_size
                name = slot[0].format(ep_rank * per_rank + slot[1])
            out[name] = (t, _layout(t, name, expert_mesh, len(expt_tp)))
        elif name == WORD_EMBEDDINGS:
            out[name] = (t, _layout(t, name, embedding_mesh, len(tp)))
        else:
            out[name] = (t, _layout(t, name, dense_mesh, len(tp)))
    return out


def _chunks(model: Model) -> list[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [cast(nn.Module, model)]


def _pg_collection(core: nn.Module) -> Any:
    pgc = getattr(core, "pg_collection", None)
    if pgc is None:
        raise ReshardError(f"{type(core).__name__} has no pg_collection: cannot tell its process groups")
    return pgc


def refit_rank(model: Model, *, group: Any = None, rank_offset: int = 0) -> int:
    """This process's rank as the entries' meshes number it (a rank of the refit `group`)."""
    groups = _Groups(_pg_collection(unwrap(_chunks(model)[0])), group, rank_offset)
    return groups.to_group(groups.me)


def entries(
    model: Model,
    *,
    group: Any = None,
    rank_offset: int = 0,
    tie_output_to_embedding: bool = True,
) -> Entries:
    """Plan entries for a Megatron-Core model (or its list of virtual-pipeline chunks).

    group: the refit process group (mesh ranks are its ranks). rank_offset: added to the
    model's ranks when the model lives in another world than `group`'s numbering.
    tie_output_to_embedding: offer the word embeddings as ``output_layer.weight`` when the
    model ties them and holds no output weight (for source models).
    """
    out: Entries = {}
    for chunk in _chunks(model):
        core = unwrap(chunk)
        pgc = _pg_collection(core)
        config = getattr(core, "config", None)
        num_experts = getattr(config, "num_moe_experts", None)
        mtp = bool(getattr(config, "mtp_num_layers", None))
        for name, item in _chunk_entries(core, _Groups(pgc, group, rank_offset), num_experts, mtp).items():
            if name in out:
                raise ReshardError(f"two model chunks both hold '{name}' (check layer_number)")
            out[name] = item
        if (
            tie_output_to_embedding
            and getattr(core, "share_embeddings_and_output_weights", False)
            and WORD_EMBEDDINGS in out
            and OUTPUT_LAYER not in out
        ):
            out[OUTPUT_LAYER] = out[WORD_EMBEDDINGS]
    return out


__all__ = ["entries", "refit_rank", "unwrap", "WORD_EMBEDDINGS", "OUTPUT_LAYER"]
