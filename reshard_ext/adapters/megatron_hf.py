"""A Megatron-Core GPTModel described under Hugging Face checkpoint names.

`entries` takes the Megatron adapter's description (global layer and expert indices,
every TP/PP/EP/ETP/VPP layout read from the model, see `adapters.megatron`) and renames
and cuts it into the tensors of the family's HF checkpoint (`adapters.hf_names`), as
views of the local shards — nothing is gathered or copied:

==============================================  =============================================
Megatron-Core (global names)                    Hugging Face checkpoint
==============================================  =============================================
embedding.word_embeddings.weight                model.embed_tokens.weight
output_layer.weight (tied: the embeddings)      lm_head.weight
decoder.final_layernorm.*                       model.norm.*
layers.i.input_layernorm.* /                    model.layers.i.input_layernorm.*
  self_attention.linear_qkv.layer_norm_* (TE)
layers.i.pre_mlp_layernorm.* /                  model.layers.i.post_attention_layernorm.*
  mlp.linear_fc1.layer_norm_* (TE)
self_attention.linear_qkv.{weight,bias}         self_attn.{q,k,v}_proj.* (grouped shapes)
self_attention.{q,k}_layernorm.weight           self_attn.{q,k}_norm.weight
self_attention.linear_proj.*                    self_attn.o_proj.*
mlp.linear_fc1.* (gated: [gate_r; up_r]/rank)   mlp.gate_proj.*, mlp.up_proj.* (else up_proj)
mlp.linear_fc2.*                                mlp.down_proj.*
MLA linear_q_proj / linear_q_down_proj /        self_attn.q_proj / q_a_proj / q_b_proj,
  linear_q_up_proj (+ .layer_norm_weight),        q_a_layernorm (also from q_layernorm),
  linear_kv_down_proj / linear_kv_up_proj        kv_a_proj_with_mqa / kv_b_proj,
  (+ .layer_norm_weight), linear_qkv_down_proj    kv_a_layernorm (also from kv_layernorm),
  (fused: rows [q_a; kv_a])                       q_a_proj + kv_a_proj_with_mqa
mlp.router.weight / .expert_bias                {moe}.{router}.weight / .{expert_bias}
mlp.experts.linear_fc1.weightK,                 {moe}.experts.K.{gate,up} (Mixtral w1, w3)
  mlp.experts.local_experts.K.linear_fc1.weight
mlp.experts.*fc2* (both forms)                  {moe}.experts.K.{down} (Mixtral w2)
mlp.shared_experts.linear_fc1/linear_fc2        {moe}.{shared}.gate_proj, up_proj / down_proj
mlp.shared_experts.gate_weight                  {moe}.shared_expert_gate.weight (Qwen2-MoE)
mtp.layers.k.enorm / .hnorm / .eh_proj          model.layers.{N+k}.enorm / .hnorm / .eh_proj
mtp.layers.k.final_layernorm                    model.layers.{N+k}.shared_head.norm
mtp.layers.k.mtp_model_layer.*                  model.layers.{N+k}.* (as a decoder layer's)
(source only) output_layer / word embeddings    model.layers.{N+k}.shared_head.head /
                                                  .embed_tokens (second names, not copies)
==============================================  =============================================

``layers.i`` is ``decoder.layers.i`` / ``model.layers.i`` with the global layer index
(PP stages and VPP chunks included); expert K is the global expert index (EP). Gated
``linear_fc1`` shards hold ``[gate_r; up_r]`` on every TP (or expert-TP) rank whatever
``partition_stride`` says, so gate and up are the two halves of each local shard. A
DeepSeek-V3 model's dense-first layers (``first_k_dense_replace``) are the layers with a
plain ``mlp.linear_fc1``; Megatron's persistent ``expert_bias`` becomes
``mlp.gate.e_score_correction_bias``. Mamba/hybrid layers have no entry here: a
parameter the table does not know raises, naming it (an unmapped tensor is never
dropped silently).

Multi-token prediction (``TransformerConfig.mtp_num_layers``, DeepSeek-V3's MTP, built on
the last pipeline stage): the HF checkpoint stores MTP module k as one more decoder
layer, index ``N + k`` after the ``N = num_layers`` decoder layers, with its own
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (Megatron's MTP
``final_layernorm``) beside the usual attention and MLP tensors of its
``mtp_model_layer``. Megatron's ``eh_proj`` (a ColumnParallelLinear, rows split over TP)
takes ``cat(enorm(embedding), hnorm(hidden))`` as vLLM's and SGLang's DeepSeek MTP
layers do, so its columns are the checkpoint's as they are. The MTP output head and
embeddings are the main model's in Megatron; a source also offers them under the MTP
layer's ``shared_head.head`` and ``embed_tokens`` names (what engines' MTP loaders read),
as second names of the same pieces; a destination takes them from ``lm_head`` and
``model.embed_tokens`` only. Names checked against vLLM
(``vllm/model_executor/models/deepseek_mtp.py``: ``_rewrite_spec_layer_name``), SGLang
(``python/sglang/srt/models/deepseek_nextn.py``) and Megatron-Bridge
(``megatron/bridge/models/deepseek/common.py``: its MTP mappings).

Experts are offered one by one, under the checkpoint's per-expert names: Megatron-Core
holds every expert as a parameter of its own (``weightK``, ``local_experts.K``), so no
stacked view of them exists without a copy; a stacked destination (a ``transformers`` 5
model's ``gate_up_proj``) views its own parameter per expert instead (`hf_model`).

A padded vocabulary: Megatron-LM pads the vocabulary to a multiple of
``make_vocab_size_divisible_by * TP`` (``GPTModel.vocab_size``), beyond the checkpoint's
(the HF config's ``vocab_size``). Given the checkpoint's vocabulary (``vocab_size=``,
``HFNames.vocab_size``, a HF config as ``hf_names``, or the ``transformers`` / engine
model on the other side of ``rx.swap_model_weights``), ``embed_tokens`` and ``lm_head``
are the first ``vocab_size`` rows of Megatron's vocab-parallel tensors: each TP rank
offers the real rows of its shard (an uneven ``Shard(sizes=...)``; a rank holding only
padding offers none). As a destination, Megatron's padding rows are left as they are
(no source has them). A checkpoint vocabulary larger than Megatron's raises.

The family (`hf_names.HFNames`) comes from `hf_names` (a family name such as
``"qwen3_moe"``, a HF config, or an `HFNames`), else from the model's TransformerConfig:
MLA or a router expert bias -> ``deepseek_v3``; a shared-expert gate -> ``qwen2_moe``;
other MoE -> ``qwen3_moe``; dense -> ``llama`` (Llama, Qwen2, Qwen3 and Mistral name
their dense tensors alike; Qwen2's q/k/v biases and Qwen3's q/k norms follow from the
model's own parameters). Mixtral must be asked for (``hf_names="mixtral"``).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from .. import merged, views
from ..errors import ReshardError
from ..layout import Layout, Shard
from . import Entries, megatron
from .hf_names import FAMILIES, HFNames, family

Item = tuple[torch.Tensor, Layout]
_PADDED = (megatron.WORD_EMBEDDINGS, megatron.OUTPUT_LAYER)  # vocab-parallel: rows padded beyond the checkpoint's
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_INNER = "mtp_model_layer."
_TOP = {
    megatron.WORD_EMBEDDINGS: "model.embed_tokens.weight",
    megatron.OUTPUT_LAYER: "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
}
# Layer-relative Megatron names ("{p}": weight or bias; "{e}": a global expert index) ->
# HF: a name, (gate, up) for a linear_fc1 cut in halves, None where the family has no such
# tensor, or a marker for the cuts below (_QKV, _DOWN).
_QKV, _DOWN = "grouped q/k/v", "fused MLA down projection"
Target = str | tuple[str, str] | None
_COMMON: dict[str, Target] = {
    "input_layernorm.{p}": "input_layernorm.{p}",
    "self_attention.linear_qkv.layer_norm_{p}": "input_layernorm.{p}",
    "self_attention.linear_qkv_down_proj.layer_norm_{p}": "input_layernorm.{p}",
    "pre_mlp_layernorm.{p}": "post_attention_layernorm.{p}",
    "mlp.linear_fc1.layer_norm_{p}": "post_attention_layernorm.{p}",
    "self_attention.linear_proj.{p}": "self_attn.o_proj.{p}",
    "mlp.linear_fc1.{p}": ("mlp.gate_proj.{p}", "mlp.up_proj.{p}"),
    "mlp.linear_fc2.{p}": "mlp.down_proj.{p}",
}
_GQA: dict[str, Target] = {
    "self_attention.linear_qkv.{p}": _QKV,
    "self_attention.q_layernorm.{p}": "self_attn.q_norm.{p}",
    "self_attention.k_layernorm.{p}": "self_attn.k_norm.{p}",
}
_MLA: dict[str, Target] = {
    "self_attention.linear_q_proj.{p}": "self_attn.q_proj.{p}",
    "self_attention.linear_q_down_proj.{p}": "self_attn.q_a_proj.{p}",
    "self_attention.linear_qkv_down_proj.{p}": _DOWN,
    "self_attention.linear_q_up_proj.{p}": "self_attn.q_b_proj.{p}",
    "self_attention.linear_q_up_proj.layer_norm_{p}": "self_attn.q_a_layernorm.{p}",
    "self_attention.q_layernorm.{p}": "self_attn.q_a_layernorm.{p}",
    "self_attention.linear_kv_down_proj.{p}": "self_attn.kv_a_proj_with_mqa.{p}",
    "self_attention.linear_kv_up_proj.{p}": "self_attn.kv_b_proj.{p}",
    "self_attention.linear_kv_up_proj.layer_norm_{p}": "self_attn.kv_a_layernorm.{p}",
    "self_attention.kv_layernorm.{p}": "self_attn.kv_a_layernorm.{p}",
}


# An MTP layer's own tensors, relative to mtp.layers.k / model.layers.{N+k}
_MTP_OWN: dict[str, Target] = {
    "enorm.{p}": "enorm.{p}",
    "hnorm.{p}": "hnorm.{p}",
    "eh_proj.{p}": "eh_proj.{p}",
    "final_layernorm.{p}": "shared_head.norm.{p}",
}


def _moe(f: HFNames) -> dict[str, Target]:
    """The family's MoE names: routed experts in both Megatron forms, shared experts."""
    moe, shared = f.moe_block, f"{f.moe_block}.{f.shared_experts}"
    gate, up, down = (f"{moe}.experts.{{e}}.{proj}.{{p}}" for proj in f.expert_proj)
    return {
        "mlp.router.{p}": f"{moe}.{f.router}.{{p}}",
        "mlp.router.expert_bias": f"{moe}.{f.router}.{f.expert_bias}" if f.expert_bias else None,
        "mlp.experts.linear_fc1.{p}{e}": (gate, up),
        "mlp.experts.local_experts.{e}.linear_fc1.{p}": (gate, up),
        "mlp.experts.linear_fc2.{p}{e}": down,
        "mlp.experts.local_experts.{e}.linear_fc2.{p}": down,
        "mlp.shared_experts.linear_fc1.{p}": (f"{shared}.gate_proj.{{p}}", f"{shared}.up_proj.{{p}}"),
        "mlp.shared_experts.linear_fc2.{p}": f"{shared}.down_proj.{{p}}",
        "mlp.shared_experts.gate_weight": f"{moe}.{f.shared_expert_gate}.weight" if f.shared_expert_gate else None,
    }


def _compiled(table: dict[str, Target]) -> list[tuple[re.Pattern, Target]]:
    return [(re.compile(re.escape(k).replace(r"\{p\}", "(?P<p>weight|bias)").replace(r"\{e\}", r"(?P<e>\d+)")), v)
            for k, v in table.items()]


def infer_family(config: Any) -> str:
    """The family name a TransformerConfig most likely came from (see the module doc)."""
    if getattr(config, "multi_latent_attention", False):
        return "deepseek_v3"
    if getattr(config, "num_moe_experts", None):
        if getattr(config, "moe_router_enable_expert_bias", False):
            return "deepseek_v3"
        if getattr(config, "moe_shared_expert_gate", False):
            return "qwen2_moe"
        return "qwen3_moe"
    return "llama"


class _Converter:
    """Megatron global names -> HF entries, for one model config and family."""

    def __init__(self, config: Any, names: HFNames, rank: int, vocab_size: int | None = None):
        self.config, self.rank, self.vocab_size = config, rank, vocab_size
        self.gated = bool(getattr(config, "gated_linear_unit", False))
        self.mla = bool(getattr(config, "multi_latent_attention", False))
        self.table = _compiled({**_COMMON, **(_MLA if self.mla else _GQA), **_moe(names)})
        self.mtp_table = _compiled(_MTP_OWN)
        self.num_layers = int(getattr(config, "num_layers", 0) or 0)

    def convert(self, name: str, item: Item) -> dict[str, Item] | None:
        """HF entries of one Megatron entry; None: no name for it."""
        if name in _TOP:
            return self._vocab(_TOP[name], item, name)
        m = _LAYER.match(name)
        if m:
            return self._layer(f"model.layers.{m.group(1)}.", m.group(2), name, item)
        m = _MTP.match(name)
        if not m:
            return None
        prefix, rest = f"model.layers.{self.num_layers + int(m.group(1))}.", m.group(2)
        if rest.startswith(_MTP_INNER):
            return self._layer(prefix, rest[len(_MTP_INNER):], name, item)
        for pattern, target in self.mtp_table:
            hit = pattern.fullmatch(rest)
            if hit is not None:
                return {prefix + str(target).format(**hit.groupdict()): item}
        return None

    def _layer(self, prefix: str, rest: str, name: str, item: Item) -> dict[str, Item] | None:
        """HF entries of a decoder layer's tensor `rest` (relative to the layer) under `prefix`."""
        for pattern, target in self.table:
            hit = pattern.fullmatch(rest)
            if hit is None:
                continue
            groups = hit.groupdict()
            if target is None:
                return None
            if target == _QKV:
                return merged.split_interleaved_qkv(
                    {name: item}, name, tuple(f"{prefix}self_attn.{x}_proj.{groups['p']}" for x in "qkv"),  # type: ignore[arg-type]
                    num_query_groups=self.config.num_query_groups or self.config.num_attention_heads,
                    head_dim=self.config.kv_channels)
            if target == _DOWN:
                return self._fused_down(item, prefix, groups["p"], name)
            if isinstance(target, tuple):
                return self._fc1(item, prefix + target[0].format(**groups), prefix + target[1].format(**groups), name)
            return {prefix + target.format(**groups): item}
        return None

    def _vocab(self, hf: str, item: Item, name: str) -> dict[str, Item]:
        """The checkpoint's rows of a (padded) vocab-parallel tensor; the others as they are."""
        local, layout = item
        if self.vocab_size is None or name not in _PADDED or self.vocab_size == layout.shape[0]:
            return {hf: item}
        _check_vocab(self.vocab_size, layout.shape[0], name)
        piece, lay = views.narrow(local, layout, self.rank, 0, 0, self.vocab_size, name)
        return {} if piece is None else {hf: (piece, lay)}

    def _fc1(self, item: Item, gate: str, up: str, name: str) -> dict[str, Item]:
        local, layout = item
        if not self.gated:
            return {up: item}
        halves = [p for p in layout.placements if isinstance(p, Shard) and p.dim == 0]
        if layout.shape[0] % 2 or local.shape[0] % 2 or any(p.blocks is not None for p in halves):
            raise ReshardError(f"'{name}': a gated linear_fc1 of {layout.shape[0]} rows ({layout!r}) does not "
                               f"halve into gate and up")
        half = Layout((layout.shape[0] // 2, *layout.shape[1:]), layout.dtype, layout.mesh,
                      [Shard(0) if p in halves else p for p in layout.placements])
        n = local.shape[0] // 2
        return {gate: (local.narrow(0, 0, n), half), up: (local.narrow(0, n, n), half)}

    def _fused_down(self, item: Item, prefix: str, kind: str, name: str) -> dict[str, Item]:
        local, layout = item
        q_rows = int(self.config.q_lora_rank)
        out = {}
        for hf, start, length in (("q_a_proj", 0, q_rows), ("kv_a_proj_with_mqa", q_rows, layout.shape[0] - q_rows)):
            piece, lay = views.narrow(local, layout, self.rank, 0, start, length, name)
            if piece is not None:
                out[f"{prefix}self_attn.{hf}.{kind}"] = (piece, lay)
        return out


def _check_vocab(vocab_size: Any, padded: int, what: str) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ReshardError(f"vocab_size={vocab_size!r}: the Hugging Face vocabulary must be a positive integer")
    if vocab_size > padded:
        raise ReshardError(f"the Hugging Face vocabulary ({vocab_size} tokens) is larger than the Megatron model's "
                           f"({padded}, {what}): Megatron only pads its vocabulary up, so this is another model "
                           f"or tokenizer; check the HF config's vocab_size (or hf_names / vocab_size passed)")


def _config(model: megatron.Model) -> Any:
    config = getattr(megatron.unwrap(megatron._chunks(model)[0]), "config", None)
    if config is None:
        raise ReshardError("the Megatron model has no .config (TransformerConfig): cannot tell its Hugging Face names")
    return config


def resolve(model: megatron.Model, hf_names: Any = None) -> HFNames:
    """The `HFNames` to describe `model` with: `hf_names` (see `hf_names.family`; None or
    True: inferred from the model's TransformerConfig)."""
    if hf_names is None or hf_names is True:
        return FAMILIES[infer_family(_config(model))]
    return family(hf_names)


def entries(
    model: megatron.Model,
    *,
    hf_names: Any = None,
    group: Any = None,
    rank_offset: int = 0,
    tie_output_to_embedding: bool = True,
    vocab_size: int | None = None,
) -> Entries:
    """Plan entries of a Megatron-Core GPTModel (or its list of VPP chunks) under Hugging
    Face checkpoint names: views of the local shards, never gathered.

    hf_names: the family (a name such as ``"qwen3_moe"``, a HF config, an
    `hf_names.HFNames`); None: inferred from the model's TransformerConfig.
    group, rank_offset, tie_output_to_embedding: as in `adapters.megatron.entries`; the
    latter (a source) also offers each MTP layer's ``shared_head.head`` and ``embed_tokens``.
    vocab_size: the checkpoint's vocabulary where Megatron padded its own beyond it:
    ``embed_tokens`` and ``lm_head`` are then its first `vocab_size` rows (a destination's
    padding rows are left untouched). Default: ``hf_names``' (a HF config's), else the
    model's own. Pass the same on every rank.
    Raises ReshardError naming every parameter the family's table has no name for, for a
    `vocab_size` larger than the model's (``GPTModel.vocab_size``), and for an
    ``HFNames.mtp_layers`` other than the model's ``mtp_num_layers``, on every rank.
    """
    names = resolve(model, hf_names)
    config = _config(model)
    mtp = int(getattr(config, "mtp_num_layers", None) or 0)
    _check_mtp(names.mtp_layers, mtp, int(getattr(config, "num_layers", 0) or 0))
    vocab = vocab_size if vocab_size is not None else names.vocab_size
    padded = getattr(megatron.unwrap(megatron._chunks(model)[0]), "vocab_size", None)
    if vocab is not None and isinstance(padded, int):  # every stage knows it: all ranks raise alike
        _check_vocab(vocab, padded, "GPTModel.vocab_size")
    base = megatron.entries(model, group=group, rank_offset=rank_offset,
                            tie_output_to_embedding=tie_output_to_embedding)
    conv = _Converter(config, names, megatron.refit_rank(model, group=group, rank_offset=rank_offset),
                      vocab)
    out: Entries = {}
    unknown = []
    for name, item in base.items():
        got = conv.convert(name, item)
        if got is None:
            unknown.append(name)
            continue
        for hf, entry in got.items():
            if hf in out:
                raise ReshardError(f"two Megatron tensors have the Hugging Face name '{hf}' (one is '{name}')")
            out[hf] = entry
    if unknown:
        raise ReshardError(f"{len(unknown)} Megatron tensors have no Hugging Face name in family {names}: "
                           f"{unknown[:6]}{' ...' if len(unknown) > 6 else ''}; pass hf_names= for the right family, "
                           f"or describe these tensors yourself (plan entries)")
    if tie_output_to_embedding:  # every stage knows mtp: a name's ranks all offer it
        for k in range(conv.num_layers, conv.num_layers + mtp):
            for shared, main in (("shared_head.head.weight", "lm_head.weight"),
                                 ("embed_tokens.weight", "model.embed_tokens.weight")):
                if main in out:
                    out[f"model.layers.{k}.{shared}"] = out[main]
    return out


def _check_mtp(expected: int | None, mtp: int, num_layers: int) -> None:
    """Raises unless the HF side's MTP layers (None: whatever the model has) are the model's."""
    if expected is None or expected == mtp:
        return
    layers = f"model.layers.{num_layers}" + (f"..{num_layers + expected - 1}" if expected > 1 else "")
    raise ReshardError(
        f"the Hugging Face side has {expected} multi-token-prediction layer(s) ({layers}: enorm, hnorm, eh_proj, "
        f"shared_head, ...) but the Megatron model has {mtp or 'none'} (TransformerConfig.mtp_num_layers="
        f"{mtp or None}): the MTP weights would be left stale. Build the Megatron model with "
        f"mtp_num_layers={expected} and its mtp_block_spec, or refit into a model with {mtp or 'no'} MTP layer(s)")


__all__ = ["entries", "resolve", "infer_family"]
