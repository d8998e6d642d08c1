"""Host time of a warm `rx.swap_model_weights` next to `rx.execute` of the same plan.

A warm swap must find its cached plan and check that neither model changed (storages,
shapes, strides, dtypes, parallel attributes, the module tree) before it executes, and every
rank must agree that all hit the same plan; this prints what that costs per call on top of
execute (executes and swaps alternate, so drift hits both alike): "lookup" is the warm
swap's local part (describe, key, cache), "check" the change check of both models in it
(their snapshots' unchanged()), "walk" the full fingerprint of both that a changed model
(or a Python without dict versions) costs instead, "agree" the slow path's all-reduce (a
warm swap of a small group agrees in its execute's headers instead).

    torchrun --nproc-per-node 2 benchmarks/swap_overhead.py [--layers 32] [--experts 0]
CPU (gloo) without CUDA, NCCL with it. The model is the tests' tiny Megatron-like GPT
(tests/_models.py) with tiny hidden sizes, so the per-call time is host work, not bytes;
--experts N makes every layer MoE with N experts (2 tensors each), for thousands of tensors.
--profile prints rank 0's top functions of warm swaps.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _models import GPT, Config, make_groups


def _host_times(fn: Callable[[], Any], iters: int, cuda: bool) -> list[float]:
    """Host wall seconds of each call, ranks lined up by a barrier, the device drained between calls."""
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300),
                            **({"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}))
    import reshard_ext as rx
    from reshard_ext import swap

    cfg = Config(layers=args.layers, num_moe_experts=args.experts or None)
    src = GPT(cfg, make_groups(world, base=0, tp=world, pp=1, dp=1))  # TP(world) -> TP1 replicated
    dst = GPT(cfg, make_groups(world, base=0, tp=1, pp=1, dp=world))
    if cuda:
        src.cuda()
        dst.cuda()
    tensors = sum(1 for m in (src, dst) for _ in m.parameters())
    plan = rx.prepare_swap_model_weights(src, dst)
    for _ in range(3):
        rx.swap_model_weights(src, dst)
    look = ("auto", None, 0, 0, None, None, None, None, None)  # _lookup(src, dst, backend, group, ...)
    split: list[tuple[float, float]] = []

    def warm_swap_in_two() -> None:
        """A warm swap's body (swap_model_weights of a small group), its two halves timed."""
        t0 = time.perf_counter()
        found = swap._lookup(src, dst, *look)
        t1 = time.perf_counter()
        assert found.clean and found.cached is not None
        found.cached.plan.execute(swap=found.cached.generation)
        split.append((t1 - t0, time.perf_counter() - t1))

    busy: list[float] = []

    def execute_after_busy() -> None:
        """An execute after as long a busy host as a lookup: what a swap's execute pays for
        following other work (idle cores, cold caches) rather than for the swap itself."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < statistics.median(a for a, _ in split):
            pass
        t1 = time.perf_counter()
        rx.execute(plan)
        busy.append(time.perf_counter() - t1)

    t_exec: list[float] = []
    t_swap: list[float] = []
    for _ in range(args.iters):
        t_exec += _host_times(lambda: rx.execute(plan), 1, cuda)
        t_swap += _host_times(lambda: rx.swap_model_weights(src, dst), 1, cuda)
        _host_times(warm_swap_in_two, 1, cuda)
        _host_times(execute_after_busy, 1, cuda)
    t_look = _host_times(lambda: swap._lookup(src, dst, *look), args.iters, cuda)
    snaps = [swap._snapshot([m]) for m in (src, dst)]
    assert all(s.unchanged() for s in snaps)
    t_check = _host_times(lambda: [s.unchanged() for s in snaps], args.iters, cuda)
    t_fp = _host_times(lambda: (swap._fingerprint([src]), swap._fingerprint([dst])), args.iters, cuda)
    t_agree = _host_times(lambda: swap._agree(None, False, 0), args.iters, cuda)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            rx.swap_model_weights(src, dst)
        prof.disable()
    med = {k: 1e3 * statistics.median(v) for k, v in (("exec", t_exec), ("swap", t_swap), ("look", t_look),
                                                         ("check", t_check), ("fp", t_fp), ("agree", t_agree),
                                                         ("in_look", [a for a, _ in split]),
                                                         ("in_exec", [b for _, b in split]),
                                                         ("busy", busy))}
    rows: list = [None] * world
    dist.all_gather_object(rows, (rank, med))
    if rank == 0:
        print(f"== swap_overhead: {'CUDA ' + torch.cuda.get_device_name() if cuda else 'CPU gloo'} x{world}, "
              f"{args.layers} layers, {args.experts} experts, {tensors} parameters on rank 0 (both models), "
              f"median of {args.iters}")
        print(f"{'rank':>4} {'execute ms':>10} {'swap ms':>8} {'swap-execute ms':>15} {'lookup ms':>9} "
              f"{'check ms':>8} {'walk ms':>7} {'agree ms':>8} {'in swap: lookup':>15} {'execute':>7} "
              f"{'busy+execute':>12}")
        for r, m in rows:
            print(f"{r:4d} {m['exec']:10.3f} {m['swap']:8.3f} {m['swap'] - m['exec']:15.3f} {m['look']:9.3f} "
                  f"{m['check']:8.3f} {m['fp']:7.3f} {m['agree']:8.3f} {m['in_look']:15.3f} {m['in_exec']:7.3f} "
                  f"{m['busy']:12.3f}")
        print("lookup = a warm swap's local part (describe both models, key, cache entry); check = the change check "
              "of both models in it (snapshots); walk = their full fingerprints (a changed model); agree = the slow "
              "path's all-reduce (a warm swap of <= swap.HEADER_AGREEMENT_RANKS ranks agrees in its headers); "
              "in swap = the two halves of a warm swap's body, timed inside one call; busy+execute = an execute "
              "right after the host spun as long as that lookup (the execute's cost of following other work)")
        if args.profile:
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
