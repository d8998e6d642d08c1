"""Where a direct execute's time goes before and around its GPU work (torchrun, one process per GPU).

Each step of `rx.execute` on a refit_bench case (backend "direct") is marked with a CUDA event
and the host clock: the storage check (chk), the transport's run (run), the header exchange
(hdr), the direct executor's begin and end; `wrk` is when the channel's worker took a job (host
clock only). Printed per rank, plain and verified: GPU / host ms from the call's start (medians
of 10 warm executes, each after a barrier and a synchronize, so the GPU is idle at the start:
a step's GPU time before the first kernel is host time the GPU waited for).

    torchrun --nproc-per-node 2 benchmarks/execute_steps.py tp2-tp1 moe-ep2-ep1
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from refit_bench import case_tensors

import reshard_ext as rx
from reshard_ext import execution
from reshard_ext.transports import channel, direct

Mark = tuple[str, Any, float]  # (name, CUDA event or None, host seconds)
marks: list[Mark] = []


def mark(name: str) -> None:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    marks.append((name, e, time.perf_counter()))


def wrap(obj: Any, attr: str, name: str) -> None:
    """Marks name0 / name1 around every call of obj.attr."""
    f: Callable[..., Any] = getattr(obj, attr)

    def timed(*a: Any, **k: Any) -> Any:
        mark(name + "0")
        r = f(*a, **k)
        mark(name + "1")
        return r

    setattr(obj, attr, timed)


class _Exec:
    """The direct executor behind a Python proxy (its pybind methods cannot be patched)."""

    def __init__(self, ex: Any):
        self.ex = ex

    def __getattr__(self, n: str) -> Any:
        return getattr(self.ex, n)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
    wrap(execution.Plan, "_local_problem", "chk")
    wrap(direct, "exchange_headers", "hdr")
    submit = channel.Channel.submit

    def submit_marked(self: Any, fn: Callable[[], Any]) -> Any:
        def run() -> Any:
            marks.append(("wrk", None, time.perf_counter()))
            return fn()
        return submit(self, run)

    channel.Channel.submit = submit_marked  # type: ignore[method-assign]
    for case in sys.argv[1:] or ["tp2-tp1", "moe-ep2-ep1"]:
        src, dst = case_tensors(case, rank, world)
        plan = rx.plan(src, dst, backend="direct")
        t = plan.transport
        if t.exec is not None:
            t.exec = _Exec(t.exec)
            wrap(t.exec, "begin", "begin")
            wrap(t.exec, "end", "end")
        wrap(t, "run", "run")
        for verify in (False, True):
            rows: dict[str, list[tuple[float, float]]] = {}
            for it in range(12):
                dist.barrier()
                torch.cuda.synchronize()
                marks.clear()
                mark("start")
                rx.execute(plan, verify=verify)
                mark("done")
                torch.cuda.synchronize()
                if it < 2:
                    continue
                _, start_event, start_host = marks[0]
                for name, e, h in marks[1:]:
                    gpu = start_event.elapsed_time(e) if e is not None else float("nan")
                    rows.setdefault(name, []).append((gpu, 1e3 * (h - start_host)))
            line = " ".join(f"{n}={statistics.median(g for g, _ in v):.3f}/{statistics.median(h for _, h in v):.3f}"
                            for n, v in rows.items())
            print(f"[{case} rank {rank} verify={verify}] gpu/host ms: {line}", flush=True)
        del plan
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
