"""FSDP2 trainer -> tensor-parallel inference engine, in one job on CPU (gloo).

Ranks 0-1 train a Hugging Face Llama sharded with FSDP2 (DTensor parameters, described
under its checkpoint names by rx.adapters.hf_model); ranks 2-3 serve it in an engine at TP2 whose parameters follow
vLLM's conventions (fused qkv_proj and gate_up_proj, padded vocabulary). The engine's
parameters are described by tracing its own load_weights once; every refit then moves
each engine rank's slices straight into its fused parameters.

    python examples/fsdp2_to_engine.py

The engine here is the test engine of tests/_engine.py (vLLM's parameter conventions,
no vLLM needed); with vLLM, `engine` is the worker's model (see engine_worker.py).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard_ext as rx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _engine import Config, Engine  # noqa: E402  (the stand-in engine)

TRAINERS, ENGINES = 2, 2
CFG = Config(vocab=1000, hidden=64, layers=2, heads=8, kv_heads=2, head_dim=8, inter=128)


def hf_model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=CFG.vocab, hidden_size=CFG.hidden, intermediate_size=CFG.inter, num_hidden_layers=CFG.layers,
        num_attention_heads=CFG.heads, num_key_value_heads=CFG.kv_heads, head_dim=CFG.head_dim))


def engine_model(rank: int, checkpoint: str, file: str = "model.safetensors") -> Engine:
    """Engine TP rank `rank`, loaded from `checkpoint` as an engine starts; its `config` is
    the Hugging Face config, as vLLM's and SGLang's models carry it (reshard_ext reads the
    attention heads from it, to offer q/k/v in the grouped shapes every side uses)."""
    import safetensors.torch
    import transformers

    engine = Engine(CFG, rank, ENGINES)
    engine.config = transformers.AutoConfig.from_pretrained(checkpoint)
    engine.load_weights(safetensors.torch.load_file(os.path.join(checkpoint, file)).items())
    return engine


def main(rank: int, world: int, port: int, checkpoint: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    trainer_mesh = DeviceMesh("cpu", torch.arange(TRAINERS))  # made by every rank, as DeviceMesh wants
    engine_group = dist.new_group(list(range(TRAINERS, world)))  # likewise: every rank calls new_group
    src = dst = None
    if rank < TRAINERS:
        model = hf_model()
        if rank == 0:
            model.save_pretrained(checkpoint)  # the checkpoint the engine starts from
        for layer in model.model.layers:
            fully_shard(layer, mesh=trainer_mesh)
        fully_shard(model, mesh=trainer_mesh)
        src = rx.adapters.hf_model.entries(model)  # {hf_name: (local shard or a view of it, layout)}
    dist.barrier()
    if rank >= TRAINERS:
        engine = engine_model(rank - TRAINERS, checkpoint)
        # Trace the engine's loader once: engine rank i is refit rank TRAINERS + i.
        dst = rx.adapters.engine.entries(engine, rank_offset=TRAINERS, weights=checkpoint, engine_group=engine_group)
        if rank == TRAINERS:
            print(dst.report())
    plan = rx.plan(src, dst)  # once
    for step in range(3):
        if src is not None:  # a training step: the optimizer updates the shards in place
            with torch.no_grad():
                for t, _ in src.values():
                    t.mul_(0.5).add_(step)
        rx.execute(plan)      # every refit
        if dst is not None:
            dst.finish()      # the safe path, if any tensor took it; then the engine's post-load step
        rx.verify(plan)       # every engine slice equals the trainer's tensor, bit for bit (digests)
    # An independent check: the trainer's full weights, loaded by a fresh engine through its own loader.
    if rank < TRAINERS:
        import safetensors.torch

        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective over the trainer ranks
        if rank == 0:
            safetensors.torch.save_file(full, os.path.join(checkpoint, "trained.safetensors"))
    dist.barrier()
    if rank >= TRAINERS:
        want = dict(engine_model(rank - TRAINERS, checkpoint, "trained.safetensors").named_parameters())
        assert all(torch.equal(p.view(-1).view(torch.int32), want[n].view(-1).view(torch.int32))
                   for n, p in engine.named_parameters()), "the refit engine differs from its loader's result"
    if rank == TRAINERS:
        print(f"3 refits verified, and equal to the engine's own load_weights of the trained weights; engine rank 0 "
              f"received {plan.bytes_received} bytes per refit (its slices of {len(dst)} Hugging Face tensors)")
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(main, args=(TRAINERS + ENGINES, free, d), nprocs=TRAINERS + ENGINES)
