"""Planning at cluster scale (issue 16, item 3), on one CPU core, no process group.

DeepSeek-V3-671B with every expert weight its own tensor (gate, up and down of each of
the 256 routed experts in each of the 58 MoE layers, as the Hugging Face checkpoint
stores them): 45,395 tensors, PP16·EP64 on ranks 0-1023 -> TP32·DP32 (EP32 inside each
TP32 engine) on ranks 1024-2047. (The issue counts 45,337: 58 fewer, one per MoE layer,
which matches leaving out the router's expert bias, e_score_correction_bias.)

- `rx.local_plan(src, dst, rank)` (the pure entry: build and check both tables, plan,
  batches, ops as Python objects), CPU seconds for a sample of source and of
  destination ranks: unbounded (local_plan's default) and with rx.plan's GPU default
  of 512 MiB batches (the batch count agreed as rx.plan does: the most any rank wants);
- at 8,192 ranks (the same layouts with DP four times larger), the metadata exchange of
  `rx.plan`: every rank's `all_gather_object` payload (the layouts it reports, encoded,
  pickled as torch pickles it) and what each rank receives (world x the largest
  payload: all_gather_object pads to it);
- the memory of `rx.plan`'s planning on one rank at 8,192 ranks (decode every payload,
  build and check the tables, plan with 512 MiB batches): the RSS growth of a fresh
  process doing only that (tracemalloc does not see C++).

    python benchmarks/plan_scale_bench.py [--ranks 8] [--world 2048] [--exchange-world 8192]
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

import reshard_ext as rx
from reshard_ext import _C
from reshard_ext.planning import reporter_of
from reshard_ext.synthetic import DEEPSEEK_V3, Parallel, model_layouts

GPU_BATCH = 512 << 20  # rx.plan's max_batch_bytes on GPUs by default


def layouts(world: int) -> tuple[dict, dict]:
    """PP16·EP64 on the first half of `world`, TP32 (EP32) on the second half."""
    half = world // 2
    src = model_layouts(DEEPSEEK_V3, Parallel(pp=16, dp=half // 16, ep=64), split_gate_up=True)
    dst = model_layouts(DEEPSEEK_V3, Parallel(tp=32, dp=half // 32, ep=32, offset=half), split_gate_up=True)
    return src, dst


def payloads(src: dict, dst: dict, world: int) -> list[bytes]:
    """What each rank passes to all_gather_object in rx.plan (planning.plan_collective),
    pickled: its reported layouts, no errors, device "cuda", a registration vote."""
    per_rank: dict[int, list] = defaultdict(list)
    for side, table in ((0, src), (1, dst)):
        for name, layout in table.items():
            per_rank[reporter_of(name, layout)].append((side, name, layout._c))
    return [pickle.dumps((_C.encode_entries(per_rank.get(r, [])), [], "cuda", True)) for r in range(world)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def plan_from_payloads(path: str, rank: int, world: int) -> None:
    """Child process: what rx.plan does on `rank` after the exchange; prints the CPU time
    and the largest RSS growth over the process holding the payloads (sampled after each
    step: the decoded list, the tables, the plan)."""
    with open(path, "rb") as f:
        gathered = pickle.load(f)
    base = _rss()
    t0 = time.process_time()
    blobs = [pickle.loads(p)[0] for p in gathered]
    decoded = _C.decode_entries(blobs)
    growth = _rss() - base
    src_t = _C.LayoutTable([(n, lay) for s, n, lay in decoded if s == 0])
    dst_t = _C.LayoutTable([(n, lay) for s, n, lay in decoded if s == 1])
    growth = max(growth, _rss() - base)
    del decoded, blobs
    assert not _C.check_tables(src_t, dst_t, world)
    plan = _C.plan_rank(src_t, dst_t, rank, GPU_BATCH)
    plan.assign_batches(plan.wanted_batches())
    dt = time.process_time() - t0
    print(dt, max(growth, _rss() - base), sum(plan.num_ops))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="ranks sampled per kind (source, destination)")
    ap.add_argument("--world", type=int, default=2048, help="ranks of the local_plan timing")
    ap.add_argument("--exchange-world", type=int, default=8192, help="ranks of the metadata/memory measurement")
    ap.add_argument("--child", nargs=3, metavar=("PAYLOADS", "RANK", "WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        plan_from_payloads(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, children too

    world, half = args.world, args.world // 2
    t0 = time.perf_counter()
    src, dst = layouts(world)
    print(f"{len(src)} src / {len(dst)} dst tensors, {world} ranks, layouts built in {time.perf_counter() - t0:.1f} s")
    step = max(1, half // args.ranks)
    samples = {kind: [first + i * step + (i * 7) % step for i in range(args.ranks)]
               for kind, first in (("source", 0), ("destination", half))}
    # rx.plan agrees on the largest batch count any rank wants: the busiest sampled rank's
    src_t = _C.LayoutTable([(n, lay._c) for n, lay in src.items()])
    dst_t = _C.LayoutTable([(n, lay._c) for n, lay in dst.items()])
    k = max(_C.plan_rank(src_t, dst_t, r, GPU_BATCH).wanted_batches() for rs in samples.values() for r in rs)
    del src_t, dst_t
    print(f"{'kind':12} {'ranks':>6} {'batches':>8} {'local_plan CPU s med':>20} {'max':>7} {'ops (busiest rank)':>20}")
    for mbb, nb in ((None, None), (GPU_BATCH, k)):
        for kind, sample in samples.items():
            times, ops = [], []
            for r in sample:
                t = time.process_time()
                p = rx.local_plan(src, dst, r, max_batch_bytes=mbb, num_batches=nb)
                times.append(time.process_time() - t)
                ops.append(len(p.sends) + len(p.recvs))
            print(f"{kind:12} {len(sample):6d} {p.num_batches:8d} {statistics.median(times):20.3f} {max(times):7.3f} "
                  f"{max(ops):20d}")
    del src, dst

    world = args.exchange_world
    src, dst = layouts(world)
    blobs = payloads(src, dst, world)
    del src, dst
    largest = max(len(b) for b in blobs)
    print(f"\nexchange at {world} ranks: "
          f"payload per rank median {statistics.median(len(b) for b in blobs) / 1e3:.1f} KB, "
          f"largest {largest / 1e3:.1f} KB; received per rank {world * largest / 1e6:.2f} MB "
          f"(all_gather_object pads to the largest)")
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pickle.dump(blobs, f)
        f.flush()
        for kind, rank in (("source", 0), ("destination", world // 2)):
            out = subprocess.run([sys.executable, __file__, "--child", f.name, str(rank), str(world)],
                                 check=True, capture_output=True, text=True).stdout.split()
            dt, rss, nops = float(out[0]), int(out[1]), int(out[2])
            print(f"rx.plan on {kind} rank {rank}: decode + tables + check + plan {dt:.2f} s CPU, "
                  f"RSS +{rss / 1e6:.0f} MB at most, {nops} ops")


if __name__ == "__main__":
    main()
