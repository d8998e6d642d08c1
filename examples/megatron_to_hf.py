"""Megatron-Core trainer -> Hugging Face `transformers` model, on CPU (gloo, 2 ranks).

A Llama-like Megatron-Core GPTModel at TP2 is described under Hugging Face checkpoint
names (its fused linear_qkv and linear_fc1 as q/k/v and gate/up views, never gathered);
a `transformers` LlamaForCausalLM on rank 0 receives them through one call:

    rx.swap_model_weights(megatron_model, hf_model_or_None, hf_names=True)

    python examples/megatron_to_hf.py
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard_ext as rx

TP, VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 2, 128, 64, 4, 2, 128, 2


def megatron_model():
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, ffn_hidden_size=FFN, gated_linear_unit=True,
                            normalization="RMSNorm", add_bias_linear=False, params_dtype=torch.float32,
                            use_cpu_initialization=True, tensor_model_parallel_size=TP)
    torch.manual_seed(1)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=32,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False, pg_collection=pgc)


def hf_model():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, tie_word_embeddings=False))


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    trainer = megatron_model()
    hf = hf_model() if rank == 0 else None
    for step in range(2):
        with torch.no_grad():  # a training step: parameters change in place
            for p in trainer.parameters():
                p.add_(0.01 * step)
        # Collective: ranks without the HF model pass None. hf_names=True: describe the
        # Megatron side under HF names (rank 1 has no HF model to tell it so).
        rx.swap_model_weights(trainer, hf, hf_names=True)
    # A check: the embedding rank 0 holds equals both TP shards of Megatron's.
    mine = trainer.embedding.word_embeddings.weight.detach()
    shards = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(shards, mine)
    if rank == 0:
        assert torch.equal(hf.model.embed_tokens.weight, torch.cat(shards)), "embedding differs"
        print("2 refits: the transformers model holds the Megatron TP2 weights under HF names")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(main, args=(2, free), nprocs=2)
