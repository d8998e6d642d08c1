"""Compare rx.swap_model_weights with Megatron-Core's swap_model_weights on real GPT models.

Run on a GPU machine with megatron-core installed, e.g.
  torchrun --nproc-per-node 4 benchmarks/megatron_compare.py --src-tp 2 --dst-tp 4
Builds a source and a destination GPTModel (collocated, same ranks) with the given TP
sizes, refits with both libraries, checks that the destinations are bit-identical, and
prints the warm refit time of each (median of --iters, after one cold call).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def build(tp: int, args: argparse.Namespace):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            ffn_hidden_size=4 * args.hidden, gated_linear_unit=True, bf16=True,
                            params_dtype=torch.bfloat16, tensor_model_parallel_size=tp)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=128,
                     pg_collection=pgc).cuda()
    return model


def timed(fn, iters: int) -> float:
    fn()  # cold: plans
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    for k, v in (("src-tp", 2), ("dst-tp", 4), ("layers", 4), ("hidden", 1024), ("heads", 16), ("vocab", 32000), ("iters", 10)):
        p.add_argument(f"--{k}", type=int, default=v)
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())

    import reshard_ext as rx
    from megatron.core.resharding.refit import swap_model_weights as mcore_swap
    from reshard_ext.swap import swap_model_weights as rx_swap

    src = build(args.src_tp, args)  # note: parallel_state is rebuilt per model; each keeps its pg_collection
    dst_rx, dst_mc = build(args.dst_tp, args), build(args.dst_tp, args)
    t_rx = timed(lambda: rx_swap(src, dst_rx, backend="auto"), args.iters)
    t_mc = timed(lambda: mcore_swap(src, dst_mc, "nccl"), args.iters)
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(dst_rx.state_dict().items(), dst_mc.state_dict().items())
               if isinstance(a, torch.Tensor))
    nbytes = sum(t.numel() * t.element_size() for t in dst_rx.parameters())
    if dist.get_rank() == 0:
        print(f"TP{args.src_tp}->TP{args.dst_tp} bytes/rank={nbytes} identical={same} "
              f"rx={t_rx * 1e3:.2f}ms mcore={t_mc * 1e3:.2f}ms ratio={t_mc / t_rx:.2f}x rx={rx.__name__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
