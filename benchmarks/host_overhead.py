"""Host (CPU) time that `rx.execute` spends per call for a plan with many tensors.

The descriptor tables are built and uploaded at plan time, so execute costs a few
launches and one grouped NCCL call per batch, whatever the tensor count. Also reported:
the check that no bound tensor's storage was replaced or resized (`storage check`), which
reads every bound tensor once per execute: one C++ loop over torch's C data_ptr reader, or
with `--tensor-data-ptr` the fallback used where torch has none (Tensor.data_ptr per tensor).
Both are CPU time of the calling thread; the check's line also gives its wall time (helper
threads share the check of a large plan: RESHARD_EXT_CHECK_THREADS) and its wall time per bound
tensor (every src and dst piece: 20,000 for the default 10,000 tensors). `--device cpu` runs
it over gloo (there the execute time includes the copies themselves, which run on the
calling thread).

    torchrun --nproc-per-node 2 benchmarks/host_overhead.py [--tensors 10000] [--device cpu] [--tensor-data-ptr]
        [--profile]

--profile then prints rank 0's top functions (cProfile, by own time) over warm executes of
the same plan built with rx.Options(check_storage=False): where the rest of the host time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Shard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tensor-data-ptr", action="store_true", help="the storage check's fallback path")
    ap.add_argument("--profile", action="store_true", help="rank 0's top functions of executes without the check")
    args = ap.parse_args()
    if args.tensor_data_ptr:
        from reshard_ext import watch

        watch.DATA_PTR_FN = 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    ranks = list(range(world))
    src, dst = {}, {}
    for i in range(args.tensors):
        shape = (64, 32)
        s = Layout(shape, torch.bfloat16, Mesh(ranks), [Shard(0)])
        d = Layout(shape, torch.bfloat16, Mesh(ranks[::-1]), [Shard(1)])
        src[f"t{i}"] = (torch.randn(s.local_shape(rank), device=args.device).to(torch.bfloat16), s)
        dst[f"t{i}"] = (torch.empty(d.local_shape(rank), device=args.device, dtype=torch.bfloat16), d)
    t0 = time.perf_counter()
    plan = rx.plan(src, dst)
    plan_s = time.perf_counter() - t0
    for _ in range(3):
        rx.execute(plan)
    sync()
    cpu, check, check_wall = [], [], []
    for _ in range(args.iters):
        t0 = time.thread_time()
        rx.execute(plan)
        cpu.append(time.thread_time() - t0)
        sync()
        t0, w0 = time.thread_time(), time.perf_counter()
        if hasattr(plan, "_watch"):  # absent before the storage check existed
            plan._watch.changed(rank)
        check.append(time.thread_time() - t0)
        check_wall.append(time.perf_counter() - w0)
    watch = getattr(plan, "_watch", None)
    how = "none" if watch is None else "C++ loop" if getattr(watch, "fast", None) is not None else "Tensor.data_ptr"
    bound = len(watch.tensors) if watch is not None else 0
    threads = plan.options.resolved_check_threads() if hasattr(plan.options, "resolved_check_threads") else 1
    how += f", {threads} threads" if threads > 1 else ""
    row = (rank, plan_s, cpu, sum(plan.num_ops), check, how, bound, check_wall)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r, ps, c, ops, chk, how, bound, chk_wall in rows:
            each = f", {1e9 * statistics.median(chk_wall) / bound:.1f} ns per bound tensor" if bound else ""
            print(f"host_overhead ({args.device}): rank {r}: {args.tensors} tensors, {ops} boxes, plan {ps:.2f} s, "
                  f"execute CPU time {1e3 * statistics.median(c):.3f} ms (min {1e3 * min(c):.3f}), of which "
                  f"storage check ({how}) {1e3 * statistics.median(chk):.3f} ms (min {1e3 * min(chk):.3f}), wall "
                  f"{1e3 * statistics.median(chk_wall):.3f} ms{each}; medians of {args.iters}")
    if args.profile:
        unchecked = rx.plan(src, dst, options=rx.Options(check_storage=False))
        for _ in range(3):
            rx.execute(unchecked)
        sync()
        prof = cProfile.Profile()  # wall time: a wait shows as the lock's acquire
        cpu = []
        for _ in range(args.iters):
            t0 = time.thread_time()
            prof.enable()
            rx.execute(unchecked)
            prof.disable()
            cpu.append(time.thread_time() - t0)
            sync()
        if rank == 0:
            print(f"host_overhead --profile: rank 0, check_storage=False: execute CPU time "
                  f"{1e3 * statistics.median(cpu):.3f} ms under cProfile (median of {args.iters}); "
                  "top functions by own time:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
