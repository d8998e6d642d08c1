"""Refit of a small synthetic dense model with BF16 -> MXFP8 on the fly.

Every 2-D weight moves from TP=world sharded on one dim to TP=world sharded on the
other dim (so nearly every byte crosses ranks) and, with --mxfp8, lands as E4M3 data +
E8M0 scales. Prints the wire bytes (all ranks) and the time per refit.

  python benchmarks/mxfp8_bench.py --world 2 --mxfp8 sender          # spawns ranks
  torchrun --nproc-per-node 2 benchmarks/mxfp8_bench.py --mxfp8 receiver
CUDA tensors and NCCL when a GPU per rank is present, else CPU tensors over gloo.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


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
    from reshard_ext.mxfp8 import MXFP8, scale_numel

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    dev = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    mesh = rx.Mesh(list(range(world)))
    shapes = model(args.layers, args.hidden, args.ffn)
    src, dst = {}, {}
    for name, shape in shapes.items():
        sl = rx.Layout(shape, torch.bfloat16, mesh, [rx.Shard(0)])
        dl = rx.Layout(shape, torch.bfloat16, mesh, [rx.Shard(1)])
        src[name] = (torch.randn(sl.local_shape(rank), device=dev).to(torch.bfloat16), sl)
        local = dl.local_shape(rank)
        if args.mxfp8 == "none":
            dst[name] = (torch.empty(local, dtype=torch.bfloat16, device=dev), dl)
        else:
            data = torch.empty(local, dtype=torch.float8_e4m3fn, device=dev)
            scale = torch.empty(scale_numel(local, args.scale_layout), dtype=torch.uint8, device=dev)
            dst[name] = ((data, scale), dl)
    transform = None if args.mxfp8 == "none" else \
        MXFP8(list(shapes), scale_layout=args.scale_layout, where=args.mxfp8, rounding=args.rounding)
    plan = rx.plan(src, dst, transform=transform)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

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
    if rank == 0:
        bf16 = sum(a * b for a, b in shapes.values()) * 2
        t = statistics.median(times)
        print(f"mxfp8={args.mxfp8} scale_layout={args.scale_layout} world={world} device={dev.type} "
              f"bf16_bytes={bf16} wire_bytes={sent.item()} wire/bf16={sent.item() / bf16:.3f} "
              f"refit_ms={t * 1e3:.2f} logical_GBps={bf16 / t / 1e9:.2f}")


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
    ap.add_argument("--mxfp8", choices=["receiver", "sender", "none"], default="sender")
    ap.add_argument("--scale-layout", choices=["2d", "swizzled"], default="swizzled")
    ap.add_argument("--rounding", choices=["ceil", "floor"], default="ceil")
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
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
