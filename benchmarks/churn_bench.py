"""Memory over many refits: 1,000 executes of one plan, then 1,000 plans built, executed
once and dropped. Reports each phase's growth of host RSS and of GPU memory (allocated and
reserved by torch's caching allocator) and whether every result was bit-identical.

    torchrun --nproc-per-node 2 benchmarks/churn_bench.py [--count 1000] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Shard


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _plan(rank: int, world: int, device: str, seed: int, tensors: int = 64):
    src, dst, want = {}, {}, {}
    for i in range(tensors):
        shape = (64 * world, 256)
        s = Layout(shape, torch.bfloat16, Mesh(list(range(world))), [Shard(0)])
        d = Layout(shape, torch.bfloat16, Mesh(list(range(world))), [Shard(1)])
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)).to(torch.bfloat16)
        src[f"t{i}"] = (s.local_part(g, rank).to(device), s)
        dst[f"t{i}"] = (torch.zeros(d.local_shape(rank), dtype=torch.bfloat16, device=device), d)
        want[f"t{i}"] = d.local_part(g, rank)
    return rx.plan(src, dst), dst, want


def _same(dst: dict, want: dict) -> bool:
    return all(torch.equal(t.cpu().view(torch.int16), want[n].view(torch.int16)) for n, (t, _) in dst.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def mem() -> tuple[float, float, float]:
        sync()
        gc.collect()
        gpu = (torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20) if cuda else (0.0, 0.0)
        return (_rss_mb(), *gpu)

    plan, dst, want = _plan(rank, world, args.device, 0)
    for _i in range(20):  # warm up: allocator pools, connections, one plan built and dropped
        rx.execute(plan)
        _plan(rank, world, args.device, 1000)
    m0, ok = mem(), True
    t0 = time.perf_counter()
    for i in range(args.count):
        rx.execute(plan, version=i)
    sync()
    exec_ms = 1e3 * (time.perf_counter() - t0) / args.count
    ok = _same(dst, want)
    m1 = mem()
    t0 = time.perf_counter()
    for i in range(args.count):
        p, d, w = _plan(rank, world, args.device, 1000)
        rx.execute(p)
        if i % 100 == 0:
            ok = ok and _same(d, w)
        del p, d, w
    sync()
    plan_ms = 1e3 * (time.perf_counter() - t0) / args.count
    m2 = mem()
    rows: list = [None] * world
    dist.all_gather_object(rows, (rank, m0, m1, m2, exec_ms, plan_ms, ok))
    if rank == 0:
        for r, a, b, c, e, p, same in rows:
            n = args.count
            print(f"churn ({args.device}): rank {r}: {n} executes {e:.2f} ms each, RSS {b[0] - a[0]:+.1f} MiB, "
                  f"GPU allocated {b[1] - a[1]:+.1f} / reserved {b[2] - a[2]:+.1f} MiB; {n} plans built, executed, "
                  f"dropped {p:.1f} ms each, RSS {c[0] - b[0]:+.1f} MiB, GPU allocated {c[1] - b[1]:+.1f} / reserved "
                  f"{c[2] - b[2]:+.1f} MiB; results identical: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
