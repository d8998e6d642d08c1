"""Trace vLLM's own model classes with reshard_ext on CPU (not part of CI: vLLM is not a
dependency). Builds vLLM's LlamaForCausalLM or Qwen3MoeForCausalLM from a tiny random
`transformers` checkpoint at engine TP = the number of processes (gloo), traces its
load_weights (rx.adapters.engine.trace), lands the checkpoint through the traced entries
and compares every parameter with a second copy loaded by vLLM's own load_weights.

vLLM 0.33.0 wants torch 2.14; installed without its dependencies beside this torch:
    pip download vllm==0.33.0 --no-deps -d wheels
    pip install --no-deps --target /tmp/vllm wheels/vllm-0.33.0-*.whl
    pip install --no-deps --target /tmp/vllm-deps <what the import asks for: psutil, msgspec,
        pyzmq, cloudpickle, blake3, cachetools, py-cpuinfo, einops, regex, openai, fastapi, ...>
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm:/tmp/vllm-deps:. python tools/trace_vllm.py llama 2 [tie]
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm:/tmp/vllm-deps:. python tools/trace_vllm.py qwen3moe 2 [ep]
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def checkpoint(kind: str, where: str, tie: bool) -> str:
    import transformers

    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=tie)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                          moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                          max_position_embeddings=128, decoder_sparse_step=1, mlp_only_layers=[])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(where)  # the checkpoint layout: per-expert names for MoE
    return where


def worker(rank: int, world: int, kind: str, where: str, port: int, ep: bool, q: object) -> None:
    steps: list[str] = []
    try:
        import safetensors.torch
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.models.llama import LlamaForCausalLM
        from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
        from vllm.utils.torch_utils import set_default_torch_dtype

        import reshard_ext as rx

        mc = ModelConfig(model=where, dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0)

        def config() -> VllmConfig:  # one per model: vLLM registers each attention layer by name in it
            return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                              parallel_config=ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=ep))

        cls = LlamaForCausalLM if kind == "llama" else Qwen3MoeForCausalLM
        models = []
        for i in range(2):
            vc = config()
            with set_current_vllm_config(vc):
                if i == 0:
                    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
                    initialize_model_parallel(tensor_model_parallel_size=world)
                with set_default_torch_dtype(torch.float32), torch.device("cpu"):
                    models.append(cls(vllm_config=vc))
        model, ref = models
        steps.append("built")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        hf = {}
        for f in sorted(os.listdir(where)):
            if f.endswith(".safetensors"):
                hf.update(safetensors.torch.load_file(os.path.join(where, f)))
        entries = rx.adapters.engine.trace(model, weights=where)
        steps.append("traced")
        for name, (view, layout) in entries.items():  # what rx.execute delivers
            view.copy_(layout.local_part(hf[name].reshape(layout.shape), entries.rank).to(view.dtype))
        entries.finish()
        ref.load_weights(iter(hf.items()))
        got, want = dict(model.named_parameters()), dict(ref.named_parameters())
        bad = [n for n in want if not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                                  want[n].reshape(-1).view(torch.uint8))]
        q.put((rank, steps, entries.report(), bad, {n: repr(lay) for n, (_, lay) in entries.items()}))
    except BaseException:
        q.put((rank, steps, traceback.format_exc(), None, {}))


def main() -> None:
    kind, tp = sys.argv[1], int(sys.argv[2])
    where = checkpoint(kind, tempfile.mkdtemp(), "tie" in sys.argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, tp, kind, where, port, "ep" in sys.argv, q)) for r in range(tp)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, steps, report, bad, _ in results:
        print(f"=== {' '.join(sys.argv[1:])} rank {rank}: {steps}\n{report}\nparameters that differ: {bad}")
    for name, layout in list(results[-1][4].items())[:6]:
        print(f"  {name}: {layout}")


if __name__ == "__main__":
    main()
