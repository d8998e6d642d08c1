"""Where a refit's GPU time goes, stream by stream (torchrun, one process per GPU).

For each backend and case, two views of `rx.execute`, plain and verified:
- `--profile`: one execute of each under torch.profiler (CUPTI), printed per rank as every
  stream's kernels and copies (count, first start .. last end in ms from the execute's first
  GPU activity, busy ms), then the copy-engine peer copies' totals (count, busy, span, the
  gaps between them). Profiling slows the host's launches: read spans, not totals.
- always: without a profiler, the median of 5 warm executes (plain and verified alternating,
  twice) of when the data path ends (a CUDA event queued where the verify check starts,
  DeviceDigests.lane_difference) and when the execute does; "tail" is the check's share.

    torchrun --nproc-per-node 2 benchmarks/gpu_streams.py --backend direct,nccl --profile tp2-tp1 moe-ep2-ep1
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from refit_bench import CASES, case_tensors
from torch.profiler import ProfilerActivity, profile

import reshard_ext as rx
from reshard_ext.transports import digests

_checks: list[Any] = []  # CUDA events queued where a verified execute's check starts


def _mark_check() -> None:
    lane_difference = digests.DeviceDigests.lane_difference

    def marked(self: Any) -> torch.Tensor:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        _checks.append(e)
        return lane_difference(self)

    digests.DeviceDigests.lane_difference = marked  # type: ignore[method-assign]


def _streams(plan: Any, verify: bool) -> list[str]:
    """Per stream: what one execute ran on it, and the copy-engine copies' totals."""
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        rx.execute(plan, verify=verify)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not gpu:
        return ["   (no GPU activity)"]
    t0 = gpu[0]["ts"]
    rows: dict[tuple[Any, str], list[float]] = collections.OrderedDict()
    for e in gpu:
        row = rows.setdefault((e["tid"], e["name"][:50]), [0, e["ts"], 0.0, 0.0])
        row[0] += 1
        row[2] = max(row[2], e["ts"] + e["dur"])
        row[3] += e["dur"]
    lines = [f"   stream {str(tid):>4} {name:50s} n={n:5d} {(s - t0) / 1e3:7.3f}..{(end - t0) / 1e3:7.3f} ms "
             f"busy {busy / 1e3:7.3f}" for (tid, name), (n, s, end, busy) in rows.items()]
    peer = [e for e in gpu if e["name"].startswith("Memcpy PtoP")]
    if peer:
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(peer, peer[1:])]
        lines.append(f"   peer copies: n={len(peer)} busy {sum(e['dur'] for e in peer) / 1e3:.3f} ms, span "
                     f"{(peer[-1]['ts'] + peer[-1]['dur'] - peer[0]['ts']) / 1e3:.3f} ms, gaps "
                     f"{sum(g for g in gaps if g > 0) / 1e3:.3f} ms")
    return lines


def _ends(plan: Any, verify: bool, iters: int = 5) -> tuple[float, float]:
    """Median ms from an execute's start to its data path's end and to its end."""
    data, total = [], []
    for it in range(iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        _checks.clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rx.execute(plan, verify=verify)
        end.record()
        torch.cuda.synchronize()
        if it >= 2:  # warm
            total.append(start.elapsed_time(end))
            data.append(start.elapsed_time(_checks[0] if _checks else end))
    return statistics.median(data), statistics.median(total)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=["tp2-tp1", "moe-ep2-ep1"], choices=sorted(CASES))
    ap.add_argument("--backend", default="direct", help="a comma list of rx.plan backends, each timed in turn")
    ap.add_argument("--profile", action="store_true", help="also print each stream's work under torch.profiler")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
    _mark_check()
    for backend in args.backend.split(","):
        for case in args.cases:
            src, dst = case_tensors(case, rank, world)
            plan = rx.plan(src, dst, backend=backend)
            if args.profile:
                for verify in (False, True):
                    _ends(plan, verify, iters=1)  # warm
                    lines = _streams(plan, verify)
                    print(f"== {case} {backend} verify={verify} rank {rank}\n" + "\n".join(lines), flush=True)
            runs = [(verify, _ends(plan, verify)) for _ in range(2) for verify in (False, True)]
            print(f"[{backend} {case} rank {rank}] ms data path / end: " + "; ".join(
                f"{'verified' if v else 'plain'} {d:.2f} / {t:.2f}" + (f" (tail {t - d:.2f})" if v else "")
                for v, (d, t) in runs), flush=True)
            del plan, src, dst
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
