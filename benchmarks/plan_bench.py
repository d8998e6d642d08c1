"""Planning cost at scale, on the CPU, with no process group (DESIGN section 6).

For real model shapes at 1000+ ranks it measures, per sampled rank, what `rx.plan`
does locally: decode every rank's metadata blob, build the global tables, check them,
and run the C++ planner for this rank. Metadata sizes are what that rank would send
(the layouts it reports) and receive in the all-gather: all_gather_object pads every
blob to the largest, so a rank receives world x the largest blob.

    python benchmarks/plan_bench.py [--ranks 8]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from reshard_ext import _C
from reshard_ext.planning import reporter_of
from reshard_ext.synthetic import DEEPSEEK_V3, LLAMA3_70B, Parallel, model_layouts

SCENARIOS = {
    "llama3-70b TP8.PP8.DP16 -> TP8.DP128": (LLAMA3_70B, Parallel(tp=8, pp=8, dp=16), Parallel(tp=8, dp=128)),
    "deepseek-v3 PP16.EP64 -> TP32.DP32/EP32": (
        DEEPSEEK_V3, Parallel(pp=16, dp=64, ep=64), Parallel(tp=32, dp=32, ep=32)),
}


def blobs_by_reporter(src: dict, dst: dict, world: int) -> list[bytes]:
    per_rank: dict[int, list] = defaultdict(list)
    for side, layouts in ((0, src), (1, dst)):
        for name, layout in layouts.items():
            per_rank[reporter_of(name, layout)].append((side, name, layout._c))
    return [_C.encode_entries(per_rank.get(r, [])) for r in range(world)]


def plan_one_rank(blobs: list[bytes], rank: int, world: int) -> tuple[float, tuple]:
    t0 = time.perf_counter()
    decoded = _C.decode_entries(blobs)
    src_t = _C.LayoutTable([(n, l) for s, n, l in decoded if s == 0])
    dst_t = _C.LayoutTable([(n, l) for s, n, l in decoded if s == 1])
    assert not _C.check_tables(src_t, dst_t, world)
    plan = _C.plan_rank(src_t, dst_t, rank, 0)
    return time.perf_counter() - t0, plan.num_ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8, help="ranks sampled per scenario")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'scenario':44} {'tensors':>8} {'world':>6} {'send KB':>8} {'sum MB':>7} {'recv MB':>8} "
          f"{'plan ms med':>11} {'plan ms max':>11} {'ops s/r/c (max rank)':>22}")
    for label, (shape, src_par, dst_par) in SCENARIOS.items():
        src = model_layouts(shape, src_par)
        dst = model_layouts(shape, dst_par)
        world = max(src_par.world + src_par.offset, dst_par.world + dst_par.offset)
        blobs = blobs_by_reporter(src, dst, world)
        sample = sorted({round(i * (world - 1) / max(1, args.ranks - 1)) for i in range(args.ranks)})
        times, ops = [], []
        for r in sample:
            dt, n = plan_one_rank(blobs, r, world)
            times.append(dt)
            ops.append(n)
        send_kb = max(len(blobs[r]) for r in range(world)) / 1e3
        sum_mb = sum(len(b) for b in blobs) / 1e6
        recv_mb = world * send_kb / 1e3
        worst = max(ops, key=sum)
        print(f"{label:44} {len(src):8d} {world:6d} {send_kb:8.1f} {sum_mb:7.2f} {recv_mb:8.2f} "
              f"{1e3 * statistics.median(times):11.1f} {1e3 * max(times):11.1f} {str(worst):>22}")


if __name__ == "__main__":
    main()
