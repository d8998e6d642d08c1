"""Hugging Face checkpoint names: the common interface between trainers and engines.

A model described under HF names offers each tensor of a HF safetensors checkpoint (what
``transformers`` loads and what vLLM's and SGLang's ``load_weights`` consume) under its
checkpoint name, e.g. ``model.layers.3.self_attn.q_proj.weight``, as a layout over the
pieces the ranks hold, never gathered. Two sides described this way refit into each
other whatever their parallel layouts and in-memory forms (Megatron's fused QKV, a
``transformers`` 5 model's stacked experts).

Shapes are the checkpoint's, with one exception: grouped-query attention's
``q_proj``, ``k_proj`` and ``v_proj`` (weights and biases) take their grouped shapes,
``q [kv_heads, heads_per_group, head_dim, *rest]`` and ``k, v [kv_heads, head_dim,
*rest]`` (the checkpoint's rows split by ``Tensor.unflatten``, same elements in the
same order). Megatron-Core keeps each TP rank's query groups interleaved with their
keys and values, so its piece of ``q_proj`` is not one 2-D strided tensor but is one
4-D view; every side describes q/k/v in these shapes (`grouped_qkv`), so they match.

`HFNames` says how a model family names what differs between families (the MoE block);
`FAMILIES` holds the families known here, by ``config.model_type``. The names follow
the families' published checkpoints; NVIDIA's Megatron-Bridge (``megatron-bridge``
0.6.2, ``megatron/bridge/models/*/..._bridge.py`` and ``deepseek/common.py``) keeps the
same Megatron-to-HF correspondence as mapping classes, which import its whole package
(training, datasets and model-provider stacks) and need Python 3.12: it is cited here,
not imported.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import views
from ..errors import ReshardError
from ..layout import Layout

Entries = dict[str, tuple[torch.Tensor, Layout]]


@dataclass(frozen=True)
class HFNames:
    """How one model family names its tensors in HF checkpoints, where families differ.

    Every family here names the rest alike: ``model.embed_tokens``, ``model.layers.{i}``
    with ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``
    (and ``q_norm``/``k_norm``; MLA: ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or
    ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``), a dense
    ``mlp.{gate,up,down}_proj``, ``model.norm`` and ``lm_head``.

    moe_block: the MoE block of a layer (``mlp``; Mixtral: ``block_sparse_moe``).
    router: its router, under the block (``gate``).
    expert_proj: one expert's gate, up and down projections, under
        ``{moe_block}.experts.{e}`` (Mixtral: ``w1``, ``w3``, ``w2``).
    shared_experts: the shared experts' MLP under the block (DeepSeek: ``shared_experts``;
        Qwen2-MoE: ``shared_expert``), with ``gate_proj``, ``up_proj``, ``down_proj``.
    shared_expert_gate: the shared experts' sigmoid gate (Qwen2-MoE), or None.
    expert_bias: the router's score-correction bias, under the router (DeepSeek-V3:
        ``e_score_correction_bias``), or None where the family has none.
    vocab_size: the checkpoint's vocabulary, the rows of ``embed_tokens`` and ``lm_head``,
        where the Megatron model pads its own beyond it (``make_vocab_size_divisible_by``);
        None: the model's own. Not a family trait: `family` takes it from a HF config.
    mtp_layers: the multi-token-prediction layers the HF side holds (DeepSeek-V3's
        ``model.layers.{num_hidden_layers + k}``); a Megatron model with another
        ``mtp_num_layers`` raises. None: the Megatron model's own. Never taken from a HF
        config: ``DeepseekV3Config`` says 1 while the ``transformers`` model and vLLM's
        main model drop that layer (an engine's MTP drafter is a model of its own).
    """

    moe_block: str = "mlp"
    router: str = "gate"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_experts: str = "shared_experts"
    shared_expert_gate: str | None = None
    expert_bias: str | None = None
    vocab_size: int | None = None
    mtp_layers: int | None = None


_DENSE = HFNames()
_DEEPSEEK = HFNames(expert_bias="e_score_correction_bias")
FAMILIES: dict[str, HFNames] = {
    "llama": _DENSE, "mistral": _DENSE, "qwen2": _DENSE, "qwen3": _DENSE,
    "qwen3_moe": _DENSE, "olmoe": _DENSE, "deepseek_v2": _DENSE,
    "qwen2_moe": HFNames(shared_experts="shared_expert", shared_expert_gate="shared_expert_gate"),
    "mixtral": HFNames(moe_block="block_sparse_moe", expert_proj=("w1", "w3", "w2")),
    "deepseek_v3": _DEEPSEEK, "glm4_moe": _DEEPSEEK,
}


def family(spec: Any) -> HFNames:
    """The `HFNames` of `spec`: an `HFNames`, a family name (``"qwen3_moe"``), or a HF
    config (an object or dict with ``model_type``; its ``vocab_size`` too)."""
    if isinstance(spec, HFNames):
        return spec
    model_type = spec if isinstance(spec, str) else _field(spec, "model_type")
    names = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if names is None:
        raise ReshardError(f"no Hugging Face name table for {spec!r}: known families are {sorted(FAMILIES)}; "
                           f"pass hf_names=rx.adapters.hf_names.HFNames(...) for another one")
    return names if isinstance(spec, str) else with_vocab(names, spec)


def _field(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def with_vocab(names: HFNames, config: Any) -> HFNames:
    """`names` with the vocabulary of the HF `config` (its text config's ``vocab_size``),
    unless `names` has one already or the config names none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = _field(text, "vocab_size")
    if names.vocab_size is not None or not isinstance(vocab, int) or isinstance(vocab, bool):
        return names
    return dataclasses.replace(names, vocab_size=vocab)


_QKV = re.compile(r"^(.*\.)q_proj\.(weight|bias)$")


def attention_shape(config: Any) -> dict[str, int] | None:
    """``grouped_qkv``'s keywords from a Hugging Face config (None: it names no attention heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return dict(num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim)


def grouped_qkv(entries: Mapping[str, tuple[torch.Tensor, Layout]], rank: int, *, num_heads: int,
                num_kv_heads: int, head_dim: int) -> Entries:
    """`entries` with grouped-query attention's q/k/v in their grouped shapes (see the
    module's docstring): every ``X.q_proj.{weight,bias}`` whose ``X.k_proj`` is present,
    with its ``num_heads * head_dim`` rows (and k's, v's ``num_kv_heads * head_dim``)."""
    out = dict(entries)
    groups = num_kv_heads
    if groups < 1 or num_heads % groups:
        raise ReshardError(f"{num_heads} attention heads do not form {groups} key/value groups")
    for name in entries:
        m = _QKV.match(name)
        if not m or f"{m.group(1)}k_proj.{m.group(2)}" not in entries:
            continue
        for proj, sizes in (("q_proj", (groups, num_heads // groups, head_dim)), ("k_proj", (groups, head_dim)),
                            ("v_proj", (groups, head_dim))):
            key = f"{m.group(1)}{proj}.{m.group(2)}"
            if key not in out:
                raise ReshardError(f"'{name}' has a k_proj but no '{key}'")
            piece, layout = out[key]
            if layout.shape[0] != _prod(sizes) or len(layout.shape) != (2 if m.group(2) == "weight" else 1):
                raise ReshardError(f"'{key}': shape {layout.shape} is not {_prod(sizes)} rows of "
                                   f"{num_heads} heads / {groups} key-value heads of {head_dim}")
            view, lay = views.split_dim(piece, layout, rank, 0, sizes, key)
            if view is None:
                del out[key]
            else:
                out[key] = (view, lay)
    return out


def _prod(sizes: Any) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


__all__ = ["HFNames", "FAMILIES", "family", "with_vocab", "grouped_qkv", "attention_shape"]
