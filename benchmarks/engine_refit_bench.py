"""A refit into an inference engine, two ways, on the same GPUs in the same run:

- the engines' own path, as vLLM's NCCL weight-transfer engine and SGLang's
  ``update_weights_from_distributed`` do it: the trainer gathers each full Hugging Face
  tensor (all-gather over its FSDP ranks), trainer rank 0 broadcasts it to every engine
  rank, and each engine rank's ``load_weights`` slices what it keeps;
- reshard_ext through the engine's traced loader (rx.adapters.engine): each engine rank
  receives only the slices its parameters hold, straight into them.

Non-collocated: trainer ranks 0..T-1 hold every Hugging Face tensor split on dim 0
(FSDP2-like); engine ranks T..T+E-1 run E/engine_tp replicas of an engine with vLLM's
parameter conventions (tests/_engine.py: fused qkv_proj and gate_up_proj, padded
vocabulary) at TP engine_tp. Each method refits its own copy of the engine; the copies
are checked bit-identical. Prints per method the refit time (median of --iters, slowest
rank), the model's bytes over that time (GB/s), and the bytes each engine rank received.

    torchrun --nproc-per-node 4 benchmarks/engine_refit_bench.py --trainers 2 --engine-tp 2            # 2 -> 2
    torchrun --nproc-per-node 8 benchmarks/engine_refit_bench.py --trainers 4 --engine-tp 2            # 4 -> 4 (DP2)
    torchrun --nproc-per-node 8 benchmarks/engine_refit_bench.py --trainers 4 --engine-tp 4            # 4 -> 4 (TP4)
    torchrun --nproc-per-node 4 benchmarks/engine_refit_bench.py --cpu --tiny                          # a CPU check

Default shapes: Llama-3-8B (32 layers, hidden 4096, 32 heads, 8 KV heads, SwiGLU 14336,
vocab 128256), bf16; --layers/--hidden/... or --tiny for smaller.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _engine import Config, Engine, hf_shapes  # noqa: E402

import reshard_ext as rx  # noqa: E402

# torch 2.13 names all_gather_into_tensor all_gather_single (the old name warns)
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _timed(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Median seconds of fn over iters, every rank lined up by a barrier first; the
    slowest rank's time (a refit ends when its last rank has its weights)."""
    cuda = device.type == "cuda"
    fn()  # warm: communicators, allocator
    out = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(out)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _fsdp_pieces(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], trainers: int, rank: int,
                 device: torch.device) -> dict:
    """This trainer rank's piece of every tensor (split evenly on dim 0, random values) as plan entries."""
    out = {}
    for name, (shape, dtype) in specs.items():
        if shape[0] % trainers:
            raise SystemExit(f"'{name}' of {shape[0]} rows does not split evenly over {trainers} trainer ranks")
        layout = rx.Layout(shape, dtype, rx.Mesh(list(range(trainers))), [rx.Shard(0)])
        local = layout.local_shape(rank)
        assert local is not None
        out[name] = (torch.randn(local, device=device).to(dtype), layout)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--engine-tp", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a functional check, not a measurement)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 256")
    p.add_argument("--iters", type=int, default=5)
    for k, v in (("layers", 32), ("hidden", 4096), ("heads", 32), ("kv-heads", 8), ("inter", 14336),
                 ("vocab", 128256)):
        p.add_argument(f"--{k}", type=int, default=v)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers, tp = args.trainers, args.engine_tp
    engines = world - trainers
    if engines < tp or engines % tp:
        raise SystemExit(f"{engines} engine ranks do not hold replicas of a TP{tp} engine")
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if args.tiny:
        args.layers, args.hidden, args.heads, args.kv_heads, args.inter, args.vocab = 2, 256, 8, 2, 512, 1000
    cfg = Config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.hidden // args.heads, inter=args.inter,
                 dtype=torch.float32 if args.cpu else torch.bfloat16)
    trainer_group = dist.new_group(list(range(trainers)))
    engine_group = dist.new_group(list(range(trainers, world)))
    bcast_group = dist.new_group([0] + list(range(trainers, world)))  # trainer rank 0 -> every engine rank

    # The checkpoint's tensor list (names, shapes, dtypes) on every rank; values on the trainers.
    specs = {n: (shape, cfg.dtype) for n, shape in hf_shapes(cfg).items()}
    model_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
    src, baseline_engine, rx_engine, dst = None, None, None, None
    trace_s = 0.0
    if rank < trainers:
        torch.manual_seed(rank)
        src = _fsdp_pieces(specs, trainers, rank, device)
    else:
        e = rank - trainers
        with torch.device(device):
            baseline_engine, rx_engine = Engine(cfg, e % tp, tp), Engine(cfg, e % tp, tp)
        t0 = time.perf_counter()
        dst = rx.adapters.engine.entries(rx_engine, rank_offset=trainers, weights=specs, engine_group=engine_group)
        trace_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = rx.plan(src, dst)
    plan_s = time.perf_counter() - t0

    def reshard() -> None:
        rx.execute(plan)
        if dst is not None:
            dst.finish()

    def gathered() -> Any:
        """Trainer side: every full tensor, all-gathered over the trainer ranks (FSDP's
        full_tensor()), broadcast by trainer rank 0. Engine side: the same broadcasts,
        yielded one by one to the engine's load_weights (which slices them)."""
        for name, (shape, dtype) in specs.items():
            full = torch.empty(shape, dtype=dtype, device=device)
            if src is not None:
                all_gather(full, src[name][0], group=trainer_group)
            if rank == 0 or src is None:
                dist.broadcast(full, src=0, group=bcast_group)
            yield name, full

    def gather_broadcast_load() -> None:
        if baseline_engine is not None:
            baseline_engine.load_weights(gathered())
        else:
            for _ in gathered():
                pass

    t_base = _timed(gather_broadcast_load, args.iters, device)
    t_rx = _timed(reshard, args.iters, device)
    received = torch.tensor([plan.bytes_received if dst is not None else 0,
                             model_bytes if baseline_engine is not None else 0], dtype=torch.int64, device=device)
    every = [torch.zeros_like(received) for _ in range(world)]
    dist.all_gather(every, received)
    same = 1
    if rx_engine is not None and baseline_engine is not None:
        same = int(all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                       for a, b in zip(rx_engine.parameters(), baseline_engine.parameters())))
    flag = torch.tensor([same], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == trainers and dst is not None:
        print(dst.report().splitlines()[0], f"(trace {trace_s:.2f} s)", flush=True)
    if rank == 0:
        card = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
        print(f"engine refit, {trainers} trainer -> {engines} engine ranks (TP{tp} x {engines // tp} replicas), "
              f"{model_bytes / 1e9:.3f} GB model ({cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, "
              f"{cfg.dtype}), {card}; plan {plan_s:.2f} s once")
        for label, t, col in (("gather+broadcast+load_weights", t_base, 1), ("reshard_ext (traced loader)", t_rx, 0)):
            per_rank = [int(every[r][col]) for r in range(trainers, world)]
            print(f"  {label:32s} {t * 1e3:9.2f} ms  {model_bytes / t / 1e9:8.2f} GB/s  "
                  f"received per engine rank: {', '.join(f'{b / 1e9:.3f} GB' for b in per_rank)}")
        print(f"  speedup {t_base / t_rx:.2f}x; engines bit-identical: {bool(flag.item())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
