"""Real Megatron-Core GPTModels for the adapter tests (imported only where megatron.core
is installed). Models are built one after another in the same processes; each keeps the
process groups of its own pg_collection, so differently-parallel models coexist."""
from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ = 128, 16


def build(tp: int = 1, ep: int = 1, pp: int = 1, experts: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32,
          hidden: int = 64, layers: int = 2, heads: int = 4, query_groups: int = 2, ffn: int = 0,
          moe_ffn: int = 0, vocab: int = VOCAB, cuda: bool | None = None, tied: bool = False) -> Any:
    """A GPTModel (local spec, SwiGLU) with TP `tp`, PP `pp` (this rank's stage: embedding
    on the first, head on the last) and, for experts > 0, MoE layers with EP `ep`; `tied`
    shares the embedding with the head. The benchmark builds large ones with the same code."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=moe_ffn or hidden, moe_router_topk=2,
               moe_token_dispatcher_type="alltoall" if cuda else "allgather", moe_grouped_gemm=False,
               add_bias_linear=False) if experts else {}
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            num_query_groups=query_groups, ffn_hidden_size=ffn or 2 * hidden, gated_linear_unit=True,
                            params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, use_cpu_initialization=not cuda,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
                            expert_model_parallel_size=ep,
                            hidden_dropout=0.0, attention_dropout=0.0, **moe)
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    stage, stages = pgc.pp.rank(), pgc.pp.size()
    model = GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=SEQ, parallel_output=True,
                     share_embeddings_and_output_weights=tied, pre_process=stage == 0,
                     post_process=stage == stages - 1, pg_collection=pgc)
    return model.cuda() if cuda else model


def _cpu_forward_shim() -> None:
    """Megatron's attention takes a scratch buffer from a CUDA-only pool and forks the
    CUDA RNG for dropout (0 here); on CPU (CI) hand it a plain CPU tensor and a no-op
    fork instead."""
    import contextlib

    from megatron.core import utils
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

    def get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None):
        return torch.empty(tuple(tensor_shape), dtype=dtype)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def logits(model: Any) -> torch.Tensor:
    dev = next(model.parameters()).device
    if dev.type == "cpu":
        _cpu_forward_shim()
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g).to(dev)
    pos = torch.arange(SEQ, device=dev).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=dev), 1).view(1, 1, SEQ, SEQ)
    model.eval()
    with torch.no_grad():
        out = model(tokens, pos, mask).float()
    # Logits come sharded over the vocab (TP); gather them here, since Megatron's own
    # gather needs CUDA.
    tp = model.pg_collection.tp
    parts = [torch.empty_like(out) for _ in range(torch.distributed.get_world_size(tp))]
    torch.distributed.all_gather(parts, out.contiguous(), group=tp)
    return torch.cat(parts, dim=-1).cpu()


def tensors(model: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
