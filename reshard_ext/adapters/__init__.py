"""Module adapters (DESIGN section 5): turn an nn.Module into plan entries
``{global_name: (local_tensor, rx.Layout)}`` with rank-independent global names.

- ``megatron``: Megatron-Core conventions read from parameters, modules and ``pg_collection``.
- ``megatron_hf``: a Megatron-Core GPTModel under Hugging Face checkpoint names.
- ``hf_model``: a ``transformers`` model under its checkpoint names (stacked experts as views).
- ``hf_names``: the checkpoint-name conventions and model families both of them share.
- ``dtensor``: DTensor parameters (FSDP2, tensor parallel), including ``_StridedShard``.
- ``engine``: inference engines (vLLM, SGLang): models with a ``load_weights`` loader, whose
  parameters are described by tracing that loader (reshard_ext.engines).

`pick` tells which adapter describes a module and `describe` runs it; `hf_naming` says
when a Megatron model is described under Hugging Face names (its counterpart is not a
Megatron model). A name map (``NameMap``) renames entries for engines whose names differ
from the trainer's; returning None drops the entry.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import ReshardError
from ..layout import Layout

Entries = dict[str, tuple[torch.Tensor, Layout]]
NameMap = Callable[[str], str | None]


def regex_name_map(rules: Sequence[tuple[str, str]], keep_unmatched: bool = True) -> NameMap:
    """A NameMap from (pattern, replacement) rules; the first full match wins.

    e.g. ``[(r"decoder\\.layers\\.(\\d+)\\.self_attention\\.linear_qkv\\.(.*)",
    r"model.layers.\\1.self_attn.qkv_proj.\\2")]``.
    """
    compiled = [(re.compile(p), r) for p, r in rules]

    def rename(name: str) -> str | None:
        for pattern, repl in compiled:
            if pattern.fullmatch(name):
                return pattern.sub(repl, name)
        return name if keep_unmatched else None

    return rename


def apply_name_map(entries: Mapping[str, tuple[torch.Tensor, Layout]], name_map: NameMap | None) -> Entries:
    if name_map is None:
        return dict(entries)
    out: Entries = {}
    for name, item in entries.items():
        new = name_map(name)
        if new is None:
            continue
        if new in out:
            raise ReshardError(f"name map sends two tensors to '{new}' (one of them '{name}')")
        out[new] = item
    return out


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (shared ones once), then persistent buffers (state that must travel too)."""
    yield from module.named_parameters()
    for path, sub in module.named_modules():
        for bname, buf in sub._buffers.items():
            if buf is not None and bname not in sub._non_persistent_buffers_set:
                yield (f"{path}.{bname}" if path else bname), buf


from . import dtensor, engine, hf_model, hf_names, megatron, megatron_hf  # noqa: E402  (submodules use the types above)

DTENSOR, MEGATRON, ENGINE, TRANSFORMERS = "dtensor", "megatron", "engine", "transformers"


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def pick(model: Any) -> str:
    """Which adapter describes `model` (a module, or a list of virtual-pipeline chunks):
    ``"dtensor"`` (DTensor parameters: FSDP2, TP; a ``transformers`` model among them
    keeps its checkpoint names), ``"megatron"`` (a ``pg_collection``), ``"engine"`` (a
    callable ``load_weights``: vLLM, SGLang), ``"transformers"`` (a PreTrainedModel); a
    ReshardError saying what to pass instead for anything else."""
    chunks = _chunks(model)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise ReshardError(f"cannot describe a {type(model).__name__}: pass an nn.Module (or a list of Megatron "
                           f"virtual-pipeline chunks), plan entries {{name: (tensor, rx.Layout)}}, or None")
    core = megatron.unwrap(chunks[0])
    if isinstance(next(iter(core.parameters()), None), dtensor.DTensor):
        return DTENSOR
    if getattr(core, "pg_collection", None) is not None:
        return MEGATRON
    if engine.is_engine(core):
        return ENGINE
    if hf_model.is_transformers_model(core):
        return TRANSFORMERS
    raise ReshardError(
        f"no adapter describes {type(core).__name__}: it is not a Megatron-Core model (no pg_collection), has no "
        f"DTensor parameters, no load_weights (an inference engine's model) and is not a transformers "
        f"PreTrainedModel. Pass adapter=<function(model, *, group, "
        f"rank_offset) -> entries>, or plan entries {{name: (tensor, rx.Layout)}} instead of the module "
        f"(rx.merged builds them for fused tensors)")


def hf_naming(model: Any, kind: str | None, other: Any, other_kind: str | None,
              spec: Any = None) -> hf_names.HFNames | None:
    """The Hugging Face names to describe `model` (of adapter `kind`) under, or None for
    its own names. Only Megatron models are renamed: with `spec` (``hf_names=`` of
    swap_model_weights: a family name, HF config, `hf_names.HFNames`, True to infer,
    False for never), else when `other` (the model on the other side, on this rank) is
    a module that is not a Megatron model; its config names the family when it has one,
    and its ``vocab_size`` the vocabulary (where `spec` names none: a Megatron model pads
    its own, see megatron_hf)."""
    if kind != MEGATRON or spec is False:
        return None
    config = None
    if other_kind is not None and other_kind != MEGATRON:
        config = getattr(megatron.unwrap(_chunks(other)[0]), "config", None)
    if spec is None:
        if other_kind is None or other_kind == MEGATRON:
            return None
        spec = config if getattr(config, "model_type", None) in hf_names.FAMILIES else True
    names = megatron_hf.resolve(model, spec)
    return names if config is None else hf_names.with_vocab(names, config)


def describe(model: Any, kind: str, *, side: str, group: Any = None, rank_offset: int = 0,
             names: hf_names.HFNames | None = None) -> Entries:
    """Plan entries of `model` through the adapter `pick` chose. side: ``"src"`` or
    ``"dst"`` (a source Megatron model with tied embeddings also offers its output
    weight); names: describe a Megatron model under these Hugging Face names."""
    core = megatron.unwrap(_chunks(model)[0])
    if kind == DTENSOR:
        if hf_model.is_transformers_model(core):
            return hf_model.entries(core, group=group, rank_offset=rank_offset)
        return dtensor.entries(model, group=group, rank_offset=rank_offset)
    if kind == ENGINE:
        return engine.entries(core, group=group, rank_offset=rank_offset or None)
    if kind == MEGATRON:
        if names is None:
            return megatron.entries(model, group=group, rank_offset=rank_offset, tie_output_to_embedding=side == "src")
        return megatron_hf.entries(model, hf_names=names, group=group, rank_offset=rank_offset,
                                   tie_output_to_embedding=side == "src")
    return hf_model.entries(core, group=group, rank_offset=rank_offset)


__all__ = ["Entries", "NameMap", "regex_name_map", "apply_name_map", "named_tensors", "pick", "describe",
           "hf_naming", "megatron", "megatron_hf", "hf_model", "hf_names", "dtensor", "engine"]


def __dir__() -> list[str]:
    """The public names (tab completion, help()), not re, torch and the typing names used here."""
    return sorted(__all__)
