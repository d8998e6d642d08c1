"""rx.swap_model_weights next to Megatron-Core's own swap_model_weights(refit_method="nccl")
on real GPTModels, collocated on the same GPUs, with the NCCL ceiling of the same run.

    torchrun --nproc-per-node 2 benchmarks/megatron_compare.py --case tp2-tp1 [--backend nccl]
Needs megatron-core (0.19.2 was measured; on the GPU machine it is carried as a wheel).
Builds the source and two destinations (one per library) with tests/_megatron_real.py,
checks that both destinations are bit-identical, and prints per rank the warm refit
time of each (median of --iters after a cold call that plans) and their ratios to the
ceiling: one NCCL send/recv per peer of the bytes the refit moves, measured in the same
run, and the physical floor of the refit (copy-engine peer copies of those bytes with a
D2D copy of the same-rank bytes at the same time). Default sizes: a dense 6.7B bf16 GPT
(32 layers, hidden 4096, SwiGLU 11008, vocab 32000); --experts N makes every layer MoE.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import _megatron_real as mr  # noqa: E402
from _common import cuda_time, nccl_ceiling, peer_copy_ceiling  # noqa: E402

CASES = {  # name -> (src parallel, dst parallel)
    "tp2-tp1": (dict(tp=2), dict(tp=1)),
    "tp1-tp2": (dict(tp=1), dict(tp=2)),
    "ep2-ep1": (dict(ep=2), dict(ep=1)),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=sorted(CASES), default="tp2-tp1")
    p.add_argument("--backend", default="auto", help="rx.swap_model_weights' backend (default: the library's)")
    for k, v in (("layers", 32), ("hidden", 4096), ("heads", 32), ("query-groups", 32), ("ffn", 11008),
                 ("vocab", 32000), ("experts", 0), ("moe-ffn", 0), ("iters", 5)):
        p.add_argument(f"--{k}", type=int, default=v)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    from megatron.core.resharding.refit import swap_model_weights as mcore_swap

    import reshard_ext as rx

    sizes = dict(dtype=torch.bfloat16, layers=args.layers, hidden=args.hidden, heads=args.heads,
                 query_groups=args.query_groups, ffn=args.ffn, vocab=args.vocab, experts=args.experts,
                 moe_ffn=args.moe_ffn)
    src_kw, dst_kw = CASES[args.case]
    src = mr.build(seed=1, **src_kw, **sizes)
    dst_rx = mr.build(seed=2, **dst_kw, **sizes)
    dst_mc = mr.build(seed=3, **dst_kw, **sizes)
    plan = rx.prepare_swap_model_weights(src, dst_rx, backend=args.backend)
    t_rx = cuda_time(lambda: rx.swap_model_weights(src, dst_rx, backend=args.backend), args.iters)
    # the same plan without swap_model_weights' host work (finding the cached plan for the
    # two modules): what the GPU side costs alone
    t_exec = cuda_time(lambda: rx.execute(plan), args.iters)
    host = []  # host wall time of the warm plan lookup (describe both models, agree, find)
    for _ in range(args.iters):
        t0 = time.perf_counter()
        rx.prepare_swap_model_weights(src, dst_rx, backend=args.backend)
        host.append(time.perf_counter() - t0)
    t_host = statistics.median(host)
    try:
        t_mc = cuda_time(lambda: mcore_swap(src, dst_mc, "nccl"), args.iters)
        mc_error = ""
    except Exception as e:  # noqa: BLE001 - Megatron-Core refuses some layouts (e.g. EP2->EP1)
        t_mc, mc_error = float("nan"), f"{type(e).__name__}: {e}"
    t_ceil = nccl_ceiling(plan, args.iters)
    # compared in place: clones of two 6.7B models do not fit beside three of them on an 80 GB card
    ours, theirs = dst_rx.state_dict(keep_vars=False), dst_mc.state_dict(keep_vars=False)
    ours = {n: t for n, t in ours.items() if isinstance(t, torch.Tensor)}
    differ = ([f"mcore failed: {mc_error}"] if mc_error else
              sorted(n for n in ours if not torch.equal(ours[n], theirs[n])))
    local = sum(t.numel() * t.element_size() for t in ours.values()) - plan.bytes_received
    t_phys = peer_copy_ceiling(plan, args.iters, local) if plan.bytes_sent or plan.bytes_received else 0.0
    row = (rank, plan.bytes_sent, plan.bytes_received, local, t_rx, t_mc, t_ceil, len(ours), differ[:3], t_exec, t_host,
           t_phys)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"\n== megatron_compare {args.case}: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
              f"experts {args.experts}, bf16, {torch.cuda.get_device_name()} x{dist.get_world_size()}, "
              f"backend {plan.backend} ({plan.routes})")
        print(f"{'rank':>4} {'sent GB':>8} {'recv GB':>8} {'local GB':>8} {'nccl ms':>8} {'phys ms':>8} {'rx ms':>8} "
              f"{'rx/ceil':>7} {'rx/phys':>7} {'mcore ms':>9} {'mcore/ceil':>10} {'speedup':>7} {'tensors':>7} "
              f"{'execute ms':>10} {'lookup ms':>9}  bit-identical")
        for r, sent, recv, loc, trx, tmc, tc, n, bad, tex, th, tp in rows:
            print(f"{r:4d} {sent / 1e9:8.2f} {recv / 1e9:8.2f} {loc / 1e9:8.2f} {1e3 * tc:8.2f} {1e3 * tp:8.2f} "
                  f"{1e3 * trx:8.2f} {tc / trx:7.2f} {tp / trx:7.2f} {1e3 * tmc:9.2f} {tc / tmc:10.2f} "
                  f"{tmc / trx:7.2f} "
                  f"{n:7d} {1e3 * tex:10.2f} {1e3 * th:9.2f}  {'yes' if not bad else 'NO: ' + ', '.join(bad)}")
        print("x/ceil = NCCL send/recv of the same bytes / refit time (1.00 = at the link's ceiling); "
              "phys = copy-engine peer copies of the same bytes with a D2D copy of the same-rank bytes at once; "
              "speedup = mcore time / rx time; execute = rx.execute of the same plan, without "
              "swap_model_weights' host work; lookup = host time of that work (warm "
              "prepare_swap_model_weights: describe both models, agree over the group, find the plan)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
