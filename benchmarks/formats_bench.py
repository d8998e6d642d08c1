"""Refits of a small synthetic dense model with BF16 -> every low-precision format on the fly,
against the BF16 refit of the same model in the same run (reshard_ext.formats lists them).

Every 2-D weight moves from TP sharded on one dim to TP sharded on the other dim (so
nearly every byte crosses ranks): --placement swap keeps both models on all ranks
(collocated); --placement split puts the source on the first half of the ranks and the
destination on the second half (non-collocated: the link is the bottleneck). Per format
and side (where=sender: quantized on the wire; receiver: BF16 on the wire, quantized after
it lands) it prints the wire bytes (all ranks) against BF16's and the refit time against
the BF16 refit's, both measured in this run.

  python benchmarks/formats_bench.py --world 2                       # spawns ranks (CPU: gloo)
  torchrun --nproc-per-node 2 benchmarks/formats_bench.py --placement split --formats nvfp4
  python benchmarks/formats_bench.py --world 2 --tiny                # a check of the script, seconds on a CPU
CUDA tensors and NCCL (backend "auto") when a GPU per rank is present, else CPU tensors over gloo.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from reshard_ext.formats import FORMATS


def model(layers: int, hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    shapes = {}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes[p + "self_attention.linear_qkv.weight"] = (3 * hidden, hidden)
        shapes[p + "self_attention.linear_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.linear_fc1.weight"] = (2 * ffn, hidden)
        shapes[p + "mlp.linear_fc2.weight"] = (hidden, ffn)
    return shapes


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import reshard_ext as rx

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    dev = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    half = max(world // 2, 1)
    src_ranks = list(range(world)) if args.placement == "swap" else list(range(half))
    dst_ranks = list(range(world)) if args.placement == "swap" else list(range(half, world)) or [0]
    shapes = model(args.layers, args.hidden, args.ffn)
    layouts = {n: (rx.Layout(s, torch.bfloat16, rx.Mesh(src_ranks), [rx.Shard(0)]),
                   rx.Layout(s, torch.bfloat16, rx.Mesh(dst_ranks), [rx.Shard(1)])) for n, s in shapes.items()}
    src = {n: (torch.randn(sl.local_shape(rank), device=dev).to(torch.bfloat16), sl)
           for n, (sl, _) in layouts.items() if rank in sl.mesh}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def options(fmt: str) -> dict[str, str]:  # --scale-layout where the format has one, else its defaults
        return {"scale_layout": args.scale_layout} if "scale_layout" in FORMATS[fmt].options else {}

    def measure(fmt: str | None, where: str) -> tuple[int, float]:
        dst = {}
        for n, (_, dl) in layouts.items():
            if rank not in dl.mesh:
                continue
            local = dl.local_shape(rank)
            dst[n] = (torch.empty(local, dtype=torch.bfloat16, device=dev) if fmt is None else
                      FORMATS[fmt].buffers(local, dev, **options(fmt)), dl)
        transform = None if fmt is None else FORMATS[fmt].make(list(shapes), where, **options(fmt))
        plan = rx.plan(src, dst, transform=transform, backend=args.backend)
        times = []
        for i in range(args.warmup + args.iters):
            sync()
            t0 = time.perf_counter()
            rx.execute(plan)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        sent = torch.tensor([plan.bytes_sent], dtype=torch.int64, device=dev)
        dist.all_reduce(sent)
        return int(sent.item()), statistics.median(times)

    runs = [(None, "-")] + [(f, w) for f in args.formats.split(",") for w in args.where.split(",")]
    rows = []
    for rnd in range(args.rounds):  # BF16 first in every round: drift shows as a changing BF16 time
        for fmt, where in runs:
            sent, t = measure(fmt, where)
            rows.append((rnd, fmt or "bf16", where, sent, t))
    if rank == 0:
        logical = sum(a * b for a, b in shapes.values()) * 2
        print(f"formats_bench: world={world} placement={args.placement} device={dev.type} backend={args.backend} "
              f"scale_layout={args.scale_layout} logical_bf16_bytes={logical}")
        for fmt in args.formats.split(","):
            print(f"  {fmt}: {FORMATS[fmt].summary}; sender wire {FORMATS[fmt].wire_bytes('sender') / 2:.3f} of BF16")
        print(f"{'round':>5} {'format':>8} {'where':>8} {'wire MB':>9} {'wire/bf16':>9} {'refit ms':>9} "
              f"{'t/bf16':>7} {'logical GB/s':>12}")
        for rnd, fmt, where, sent, t in rows:
            base_sent, base_t = next((s, tt) for r, f, _, s, tt in rows if r == rnd and f == "bf16")
            print(f"{rnd:>5} {fmt:>8} {where:>8} {sent / 1e6:>9.2f} {sent / base_sent:>9.3f} {t * 1e3:>9.2f} "
                  f"{t / base_t:>7.3f} {logical / t / 1e9:>12.2f}")


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {sorted(FORMATS)}")
    ap.add_argument("--where", default="sender,receiver", help="sender, receiver or both (comma-separated)")
    ap.add_argument("--placement", choices=["swap", "split"], default="swap")
    ap.add_argument("--scale-layout", choices=["2d", "swizzled"], default="swizzled",
                    help="for the formats with a scale layout (the others use their defaults)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison (same plans' shapes)")
    ap.add_argument("--tiny", action="store_true",
                    help="1 layer, hidden 128 x world, ffn 256 x world, 1 iteration: a quick check")
    args = ap.parse_args()
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown:
        ap.error(f"unknown formats {sorted(unknown)}; known: {sorted(FORMATS)}")
    if args.tiny:  # shards of whole 128-element blocks (blockwise FP8's) on either dim
        world = int(os.environ.get("WORLD_SIZE", args.world))
        args.layers, args.hidden, args.ffn, args.warmup, args.iters = 1, 128 * world, 256 * world, 1, 1
    if "RANK" in os.environ:  # torchrun
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            run(rank, world, args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp
    from _common import free_port

    port = free_port()
    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
