"""Tiny Llama, Qwen3-MoE and DeepSeek-V3 as real Megatron-Core GPTModels and as the
matching `transformers` models, configured to compute the same function (imported only
where megatron.core and transformers are installed).

Same math on both sides: RMSNorm with one epsilon, SiLU-gated MLPs, plain RoPE with one
theta (no YaRN), no biases except where the family has them, dropout 0, fp32; MoE
routers with the HF family's scoring (Qwen3-MoE: softmax then top-k renormalised, which
Megatron computes as top-k then softmax; DeepSeek-V3: sigmoid, score-correction bias for
the choice only, top-k renormalised and scaled); DeepSeek-V3's first layer dense.
Megatron's forward runs on CPU with the shims of `_megatron_real` plus the router's (it
moves its weight to CUDA on every call, and creates its expert-bias buffer there); on
CUDA (device="cuda", one process per GPU) it runs as it is. `gathered` and `reference`
are the independent conversion the tests compare the refit against.
"""
from __future__ import annotations

import contextlib
import re
import zlib
from typing import Any

import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN, LAYERS, THETA, EPS = 128, 8, 64, 4, 10000.0, 1e-6
HEADS, GROUPS, FFN = 4, 2, 96
EXPERTS, MOE_FFN, TOPK = 4, 32, 2
FAMILIES = ("llama", "qwen3_moe", "deepseek_v3")


@contextlib.contextmanager
def _cuda_is_cpu() -> Any:
    """Megatron's router allocates its expert-bias buffers, and RoPE moves its
    frequencies, to torch.cuda.current_device() (no CUDA here): that device is the CPU
    while a model is built or run."""
    saved, saved_cuda = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # With MTP at PP > 1 the last stage syncs its copy of the embeddings with the first
    # stage's through .cuda() and an all-reduce: the copy stays on the CPU.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]
        torch.Tensor.cuda = saved_cuda  # type: ignore[method-assign]


def cpu_forward_shims() -> None:
    """The attention scratch-buffer and RNG shims of `_megatron_real`, and a router whose
    gating stays on the CPU (Megatron's moves the weight to CUDA on every call)."""
    import _megatron_real as mr
    from megatron.core.transformer.moe import router as mrouter
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    mr._cpu_forward_shim()

    def gating(self: Any, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, dtype)

    mrouter.Router.gating = gating


def _mla_core_attention() -> Any:
    """Megatron's local DotProductAttention computes MLA's attention as it is (the softmax
    scale is passed in; its output width is config.kv_channels = v_head_dim per head) but
    does not take the k_channels/v_channels arguments MLA passes (TE's does): it is
    handed them and drops them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def megatron_config(family: str, tp: int, pp: int, ep: int, dtype: torch.dtype = torch.float32,
                    init_std: float = 0.02, topk: int = TOPK, mtp: int | None = None) -> Any:
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    common = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=EPS, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        init_method_std=init_std,
        bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        mtp_num_layers=mtp,
    )
    moe = dict(num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_router_topk=topk,
               moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0, expert_tensor_parallel_size=1, moe_router_dtype="fp32")
    if family == "llama":
        return TransformerConfig(num_query_groups=GROUPS, **common)
    if family == "qwen3_moe":
        return TransformerConfig(num_query_groups=GROUPS, qk_layernorm=True, kv_channels=16,
                                 moe_router_pre_softmax=False, **moe, **common)
    if family == "deepseek_v3":
        return MLATransformerConfig(
            q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, kv_channels=8,
            rope_type="rope", rotary_base=THETA, qk_layernorm=True, moe_layer_freq=[0] + [1] * (LAYERS - 1),
            moe_shared_expert_intermediate_size=MOE_FFN, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_bias_update_rate=0.0,
            **moe, **common)
    raise ValueError(family)


def _device_shims(device: str) -> Any:
    """The CPU's stand-ins for CUDA while a model is built or run on the CPU; nothing on CUDA."""
    return _cuda_is_cpu() if device == "cpu" else contextlib.nullcontext()


def build_megatron(family: str, tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 0, *,
                   dtype: torch.dtype = torch.float32, device: str = "cpu", init_std: float = 0.02,
                   topk: int = TOPK, vocab: int = VOCAB, mtp: int | None = None) -> Any:
    """This rank's stage of the family's GPTModel (local spec) with every parameter and
    persistent buffer random (norms and the expert bias too, each the same on every rank
    that holds it, drawn from its global name), in `dtype` on `device` ("cuda": this
    process's current GPU). vocab: GPTModel's vocab_size (Megatron-LM's padded vocabulary).
    mtp: TransformerConfig.mtp_num_layers (multi-token prediction on the last stage)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from reshard_ext.adapters import megatron

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    cfg = megatron_config(family, tp, pp, ep, dtype=dtype, init_std=init_std, topk=topk, mtp=mtp)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    stage, stages = pgc.pp.rank(), pgc.pp.size()
    torch.manual_seed(seed)
    if device != "cpu":  # attention forks the tracker's CUDA RNG state (for dropout, 0 here)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    with _device_shims(device):
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm",
                                          pp_rank=stage)
        if cfg.multi_latent_attention:
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = _mla_core_attention()
        mtp_spec = None
        if mtp:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
        model = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=SEQ, parallel_output=True,
                         share_embeddings_and_output_weights=False, pre_process=stage == 0,
                         post_process=stage == stages - 1, position_embedding_type="rope", rotary_base=THETA,
                         pg_collection=pgc, mtp_block_spec=mtp_spec)
    prefixes = megatron._layer_prefixes(model)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dim() == 1 and t.is_floating_point() and not name.endswith("inv_freq"):
                g = torch.Generator().manual_seed(zlib.crc32(megatron._global_layer_name(name, prefixes).encode()))
                t.copy_(1.0 + 0.5 * torch.randn(t.shape, generator=g))
    return model.to(device)


def tokens(batch: int = 2, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(7))


def megatron_logits(model: Any, batch: int = 2, vocab: int = VOCAB) -> torch.Tensor | None:
    """Logits [batch, seq, vocab] (fp32, on the CPU) of the whole pipeline on the last
    stage's ranks (None elsewhere): each stage runs its layers and hands its hidden states
    to the next stage's rank of the same TP rank (what Megatron's pipeline schedule does,
    by hand). vocab: token ids are drawn below it (a padded model: the real vocabulary)."""
    dev = next(model.parameters()).device
    if dev.type == "cpu":
        cpu_forward_shims()
    pgc = model.pg_collection
    ids = tokens(batch, vocab).to(dev)
    pos = torch.arange(SEQ, device=dev).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=dev), 1).view(1, 1, SEQ, SEQ)
    pp_ranks = dist.get_process_group_ranks(pgc.pp)
    stage = pgc.pp.rank()
    model.eval()
    with torch.no_grad(), _device_shims(dev.type):
        if stage > 0:
            hidden = torch.empty(SEQ, batch, HIDDEN, dtype=model.config.pipeline_dtype, device=dev)
            dist.recv(hidden, src=pp_ranks[stage - 1])
            model.set_input_tensor(hidden)
        out = model(ids, pos, mask)
        if stage < len(pp_ranks) - 1:
            dist.send(out.contiguous(), dst=pp_ranks[stage + 1])
            return None
    parts = [torch.empty_like(out) for _ in range(pgc.tp.size())]
    dist.all_gather(parts, out.contiguous(), group=pgc.tp)
    return torch.cat(parts, dim=-1).float().cpu()


def hf_config(family: str, topk: int = TOPK, vocab: int = VOCAB) -> Any:
    import transformers

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  rms_norm_eps=EPS, max_position_embeddings=SEQ, tie_word_embeddings=False, hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": THETA})
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=FFN, num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS,
                                        attention_bias=False, mlp_bias=False, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=FFN, num_key_value_heads=GROUPS, head_dim=16,
                                           num_experts=EXPERTS, moe_intermediate_size=MOE_FFN,
                                           num_experts_per_tok=topk, norm_topk_prob=True, decoder_sparse_step=1,
                                           mlp_only_layers=[], **common)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            intermediate_size=FFN, num_key_value_heads=HEADS, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=EXPERTS, n_shared_experts=1,
            moe_intermediate_size=MOE_FFN, num_experts_per_tok=topk, n_group=1, topk_group=1, first_k_dense_replace=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, **common)
    raise ValueError(family)


def build_hf(family: str, seed: int = 5, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
             topk: int = TOPK, vocab: int = VOCAB) -> Any:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, topk, vocab), attn_implementation="eager",
                                                          dtype=dtype)
    return model.to(device).eval()


def hf_logits(model: Any, batch: int = 2) -> torch.Tensor:
    """Logits [batch, seq, vocab] (fp32, on the CPU)."""
    with torch.no_grad():
        return model(tokens(batch, model.config.vocab_size).to(model.device)).logits.float().cpu()


# Megatron modules split over TP along dim 0 (column parallel, embeddings) or dim 1 (row
# parallel); the rest (norms, router, experts at ETP1) is whole on every rank.
_DIM0 = re.compile(r"(linear_qkv|linear_fc1|linear_q_proj|linear_q_down_proj|linear_q_up_proj|linear_kv_down_proj"
                   r"|linear_kv_up_proj|eh_proj)\.weight$|^embedding\.word_embeddings\.weight$|^output_layer\.weight$")
_DIM1 = re.compile(r"(linear_proj|linear_fc2)\.weight$")


def gathered(model) -> dict[str, torch.Tensor] | None:
    """Every rank's tensors on rank 0 (on the CPU), as global Megatron tensors (global
    layer and expert indices, TP shards concatenated; gated fc1 as [gate; up]). None on
    other ranks. Copies held by two stages (MTP's embeddings) must be equal."""
    pgc = model.pg_collection
    stage, tp_rank = pgc.pp.rank(), pgc.tp.rank()
    per_stage, per_ep = LAYERS // pgc.pp.size(), EXPERTS // pgc.ep.size()
    ep_rank = pgc.ep.rank()
    mine = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
            continue
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + stage * per_stage}.",
                      name)
        name = re.sub(r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{ep_rank * per_ep + int(m.group(1))}.",
                      name)
        mine[name] = t.detach().cpu().clone()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tp_rank, mine))
    if dist.get_rank() != 0:
        return None
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, tensors in everyone:
        for name, t in tensors.items():
            seen = shards.setdefault(name, {}).setdefault(tp_rank, t)
            assert torch.equal(seen, t), name
    out = {}
    for name, by_rank in shards.items():
        parts = [by_rank[r] for r in sorted(by_rank)]
        if ".local_experts." in name or not (_DIM0.search(name) or _DIM1.search(name)):
            assert all(torch.equal(parts[0], p) for p in parts), name  # replicated over TP
            out[name] = parts[0]
        elif name.endswith("linear_fc1.weight"):  # each TP shard is [gate_r; up_r]
            halves = [p.chunk(2) for p in parts]
            out[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        else:
            out[name] = torch.cat(parts, dim=0 if _DIM0.search(name) else 1)
    return out


def reference(mg: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The HF checkpoint of the gathered Megatron tensors, written out by hand."""
    hf = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
          "lm_head.weight": mg["output_layer.weight"], "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    for i in range(LAYERS):
        _layer(hf, mg, f"decoder.layers.{i}.", f"model.layers.{i}.", family)
    for k in range(sum(1 for n in mg if n.startswith("mtp.layers.") and n.endswith(".eh_proj.weight"))):
        # DeepSeek-V3's MTP module k: checkpoint layer LAYERS + k (its shared head and
        # embeddings are the main model's in Megatron)
        m, h = f"mtp.layers.{k}.", f"model.layers.{LAYERS + k}."
        # eh_proj: both take cat(enorm(embedding), hnorm(hidden)), so its columns are as they are
        for mname, hname in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("final_layernorm", "shared_head.norm")):
            hf[f"{h}{hname}.weight"] = mg[f"{m}{mname}.weight"]
        hf[h + "shared_head.head.weight"] = mg["output_layer.weight"]
        hf[h + "embed_tokens.weight"] = mg["embedding.word_embeddings.weight"]
        _layer(hf, mg, m + "mtp_model_layer.", h, family)
    return hf


def _layer(hf: dict[str, torch.Tensor], mg: dict[str, torch.Tensor], m: str, h: str, family: str) -> None:
    """One decoder layer's checkpoint tensors (Megatron prefix m, HF prefix h) into hf."""
    hf[h + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
    hf[h + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
    hf[h + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
    if family == "deepseek_v3":
        for mname, hname in (("linear_q_down_proj", "q_a_proj"), ("linear_q_up_proj", "q_b_proj"),
                             ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("linear_kv_up_proj", "kv_b_proj"),
                             ("q_layernorm", "q_a_layernorm"), ("kv_layernorm", "kv_a_layernorm")):
            hf[f"{h}self_attn.{hname}.weight"] = mg[f"{m}self_attention.{mname}.weight"]
    else:
        qkv = mg[m + "self_attention.linear_qkv.weight"]
        groups, hpg = GROUPS, HEADS // GROUPS
        g = qkv.view(groups, hpg + 2, -1, HIDDEN)
        hf[h + "self_attn.q_proj.weight"] = g[:, :hpg].reshape(-1, HIDDEN)
        hf[h + "self_attn.k_proj.weight"] = g[:, hpg].reshape(-1, HIDDEN)
        hf[h + "self_attn.v_proj.weight"] = g[:, hpg + 1].reshape(-1, HIDDEN)
        if family == "qwen3_moe":
            hf[h + "self_attn.q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            hf[h + "self_attn.k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
    if m + "mlp.linear_fc1.weight" in mg:  # dense (DeepSeek-V3: the first layer)
        hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"] = mg[m + "mlp.linear_fc1.weight"].chunk(2)
        hf[h + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
        return
    hf[h + "mlp.gate.weight"] = mg[m + "mlp.router.weight"]
    for e in range(EXPERTS):
        x = f"{m}mlp.experts.local_experts.{e}."
        gate, up = mg[x + "linear_fc1.weight"].chunk(2)
        hf.update({f"{h}mlp.experts.{e}.gate_proj.weight": gate, f"{h}mlp.experts.{e}.up_proj.weight": up,
                   f"{h}mlp.experts.{e}.down_proj.weight": mg[x + "linear_fc2.weight"]})
    if family == "deepseek_v3":
        hf[h + "mlp.gate.e_score_correction_bias"] = mg[m + "mlp.router.expert_bias"]
        gate, up = mg[m + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
        hf.update({h + "mlp.shared_experts.gate_proj.weight": gate, h + "mlp.shared_experts.up_proj.weight": up,
                   h + "mlp.shared_experts.down_proj.weight": mg[m + "mlp.shared_experts.linear_fc2.weight"]})


def hf_checkpoint(model: Any) -> dict[str, torch.Tensor]:
    """A transformers model's tensors in its checkpoint form (transformers' own reverse
    conversion: stacked experts back to per-expert tensors), on the CPU."""
    from transformers.core_model_loading import revert_weight_conversion

    got = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: (v[0] if isinstance(v, list) else v).cpu() for k, v in got.items()}
