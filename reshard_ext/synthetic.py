"""Synthetic model layouts with real model shapes, for the demo, tests and benchmarks.

Names follow Megatron-Core (`decoder.layers.{global index}...`, experts as
`...experts.linear_fc1.weight{global expert}`); ranks follow Megatron's default order
(tp fastest, then dp, then pp): rank = offset + tp + TP * (dp + DP * pp).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .layout import Layout, Mesh, Placement, Replicate, Shard


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    tied_embeddings: bool = False
    gated_mlp: bool = True  # SwiGLU fc1 = [gate; up]; False: GPT's plain fc1
    # MoE (0 experts: dense)
    experts: int = 0
    moe_ffn: int = 0
    first_dense_layers: int = 0
    shared_expert_ffn: int = 0
    # Multi-head latent attention (DeepSeek-V3); 0: grouped-query attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    router_bias: bool = True  # DeepSeek's aux-loss-free expert bias (Qwen3-MoE has none)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


LLAMA3_8B = ModelShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
LLAMA3_70B = ModelShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
DEEPSEEK_V3 = ModelShape(
    layers=61, hidden=7168, ffn=18432, heads=128, kv_heads=128, vocab=129280, head_dim=128,
    experts=256, moe_ffn=2048, first_dense_layers=3, shared_expert_ffn=2048,
    q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64,
)
GPT_335M = ModelShape(layers=24, hidden=1024, ffn=4096, heads=16, kv_heads=16, vocab=32000, tied_embeddings=True,
                      gated_mlp=False)
TINY_LLAMA = ModelShape(layers=4, hidden=256, ffn=512, heads=8, kv_heads=2, vocab=1024)


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1       # expert parallel size (experts split over ep ranks of each dp*tp block)
    offset: int = 0   # first rank (non-collocated models live on disjoint ranks)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_mesh(self, stage: int) -> Mesh:
        """[DP, TP] mesh of a pipeline stage."""
        return _stage_mesh(self, stage)

    def stage_of(self, layer: int, layers: int) -> int:
        per = -(-layers // self.pp)
        return min(layer // per, self.pp - 1)

    def expert_mesh(self, stage: int, expert: int, experts: int) -> Mesh:
        """Ranks holding one global expert: EP divides the stage's dp*tp ranks; the
        expert's EP rank is expert // (experts / ep), replicated over the rest."""
        return _expert_mesh(self, stage, expert // (experts // self.ep))


# Cached: a 2,048-rank model has 30,000 expert tensors sharing a few hundred meshes, and
# building each Mesh from a nested list costs more than planning a rank.
@functools.cache
def _stage_mesh(par: Parallel, stage: int) -> Mesh:
    base = par.offset + par.tp * par.dp * stage
    return Mesh.arange(par.dp, par.tp, start=base)


@functools.cache
def _expert_mesh(par: Parallel, stage: int, ep_rank: int) -> Mesh:
    ranks = par.stage_mesh(stage).ranks
    return Mesh(list(ranks[ep_rank::par.ep]))


def _tensor_layout(shape, dtype, mesh: Mesh, tp_placement: Placement | None) -> Layout:
    tp = mesh.shape[1]
    placement = tp_placement if (tp_placement is not None and tp > 1) else Replicate()
    return Layout(shape, dtype, mesh, [Replicate(), placement])


def model_layouts(
    m: ModelShape, par: Parallel, dtype: torch.dtype = torch.bfloat16, split_gate_up: bool = False
) -> dict[str, Layout]:
    """Every tensor of the model under `par`: {global name: Layout}.

    split_gate_up: every gated fc1 (dense, shared and routed experts) as two tensors,
    `linear_fc1_gate` and `linear_fc1_up`, as Hugging Face checkpoints store them.
    """
    out: dict[str, Layout] = {}
    hd, h = m.hd, m.hidden

    def add(name: str, shape, stage: int, placement: Placement | None, dt: torch.dtype = dtype) -> None:
        out[name] = _tensor_layout(shape, dt, par.stage_mesh(stage), placement)

    def fc1(prefix: str, ffn: int, stage: int, expert: str = "", mesh: Mesh | None = None) -> None:
        """A gated fc1 [gate; up] (Megatron's stride-2 TP shard), or its two halves."""
        halves = (("linear_fc1_gate", ffn), ("linear_fc1_up", ffn)) if split_gate_up else (("linear_fc1", 2 * ffn),)
        for part, rows in halves:
            name = f"{prefix}{part}.weight{expert}"
            if mesh is not None:  # a routed expert: whole on every rank of its mesh
                out[name] = Layout((rows, h), dtype, mesh, [Replicate()])
            else:
                add(name, (rows, h), stage, Shard(0) if split_gate_up else Shard(0, stride=2))

    add("embedding.word_embeddings.weight", (m.vocab, h), 0, Shard(0))
    last = par.pp - 1
    for i in range(m.layers):
        s = par.stage_of(i, m.layers)
        p = f"decoder.layers.{i}."
        if m.q_lora_rank:  # MLA: the low-rank down projections are replicated, up projections TP
            qk = hd + m.rope_head_dim
            add(p + "self_attention.linear_q_down_proj.weight", (m.q_lora_rank, h), s, None)
            add(p + "self_attention.linear_q_up_proj.layer_norm_weight", (m.q_lora_rank,), s, None)
            add(p + "self_attention.linear_q_up_proj.weight", (m.heads * qk, m.q_lora_rank), s, Shard(0))
            add(p + "self_attention.linear_kv_down_proj.weight", (m.kv_lora_rank + m.rope_head_dim, h), s, None)
            add(p + "self_attention.linear_kv_up_proj.layer_norm_weight", (m.kv_lora_rank,), s, None)
            add(p + "self_attention.linear_kv_up_proj.weight", (m.heads * 2 * hd, m.kv_lora_rank), s, Shard(0))
            add(p + "self_attention.linear_proj.weight", (h, m.heads * hd), s, Shard(1))
            add(p + "input_layernorm.weight", (h,), s, None)
        else:
            q, kv = m.heads * hd, m.kv_heads * hd
            add(p + "self_attention.linear_qkv.weight", (q + 2 * kv, h), s, Shard(0, blocks=(q, kv, kv)))
            add(p + "self_attention.linear_qkv.layer_norm_weight", (h,), s, None)
            add(p + "self_attention.linear_proj.weight", (h, q), s, Shard(1))
        moe = m.experts and i >= m.first_dense_layers
        if not moe:
            if m.gated_mlp:
                fc1(p + "mlp.", m.ffn, s)
            else:
                add(p + "mlp.linear_fc1.weight", (m.ffn, h), s, Shard(0))
            add(p + "mlp.linear_fc1.layer_norm_weight", (h,), s, None)
            add(p + "mlp.linear_fc2.weight", (h, m.ffn), s, Shard(1))
            continue
        add(p + "pre_mlp_layernorm.weight", (h,), s, None)
        add(p + "mlp.router.weight", (m.experts, h), s, None, torch.float32)
        if m.router_bias:
            add(p + "mlp.router.expert_bias", (m.experts,), s, None, torch.float32)
        if m.shared_expert_ffn:
            fc1(p + "mlp.shared_experts.", m.shared_expert_ffn, s)
            add(p + "mlp.shared_experts.linear_fc2.weight", (h, m.shared_expert_ffn), s, Shard(1))
        for e in range(m.experts):
            mesh = par.expert_mesh(s, e, m.experts)
            fc1(p + "mlp.experts.", m.moe_ffn, s, str(e), mesh)
            out[p + f"mlp.experts.linear_fc2.weight{e}"] = Layout((h, m.moe_ffn), dtype, mesh, [Replicate()])
    add("decoder.final_layernorm.weight", (h,), last, None)
    if not m.tied_embeddings:
        add("output_layer.weight", (m.vocab, h), last, Shard(0))
    return out


def total_bytes(layouts: dict[str, Layout]) -> int:
    return sum(
        torch.Size(l.shape).numel() * torch.empty((), dtype=l.dtype).element_size() for l in layouts.values()
    )
