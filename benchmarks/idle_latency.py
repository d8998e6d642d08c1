"""What a small host round trip costs right after a refit (torchrun, one process per GPU).

The verify check of an execute is small GPU work plus a collective: lane sums of a few
thousand digests, an NCCL all-reduce of 3 int64 and reading the answer. This measures its
host time issued (a) to a warm idle GPU, (b) queued while ~20 ms of memory-bound GPU work
still runs, (c) right after that work finished, and how long a short host sleep lasts with
Linux's default timer slack and with a 1 us slack (the direct transport's host waits).

    torchrun --nproc-per-node 2 benchmarks/idle_latency.py
"""
from __future__ import annotations

import ctypes
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from reshard_ext.transports.digests import DeviceDigests

_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def _sleep_us(seconds: float, n: int = 300) -> float:
    """Median microseconds that time.sleep(seconds) lasts."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(seconds)
        out.append(time.perf_counter() - t)
    return 1e6 * statistics.median(out)


def _timer_slack() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None)
    saved = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    for slack in (saved, 1000):
        libc.prctl(_PR_SET_TIMERSLACK, slack, 0, 0, 0)
        cells = ", ".join(f"{1e6 * s:.0f} us -> {_sleep_us(s):.0f} us" for s in (1e-5, 2e-5, 5e-5))
        print(f"sleep with a {slack / 1e3:.0f} us timer slack: {cells}")
    libc.prctl(_PR_SET_TIMERSLACK, saved, 0, 0, 0)


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=dev)
    digests = torch.randint(0, 2**62, (6000,), dtype=torch.int64, device=dev)
    signs = torch.ones_like(digests)
    big = torch.empty(2**28, dtype=torch.uint8, device=dev)

    device_digests = DeviceDigests(digests, signs, lambda: (np.zeros(0, np.uint64),) * 2)

    def check() -> list[int]:
        """The verify check's steps before they rode in the outcome: lane sums, a 3-int64
        all-reduce, the answer read."""
        t = torch.nn.functional.pad(device_digests.lane_difference(), (0, 1), value=0)
        work = dist.all_reduce(t, async_op=True)
        while not work.is_completed():
            os.sched_yield()
        return t.tolist()

    def busy() -> None:  # ~20 ms of memory-bound work on the current stream (H100)
        for _ in range(120):
            big.add_(1)

    def timed(fn: Callable[[], object], n: int = 60) -> float:
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return 1e3 * statistics.median(out[10:])

    idle = timed(check)
    base = timed(lambda: (busy(), torch.cuda.synchronize()))
    queued = timed(lambda: (busy(), check())) - base
    after = timed(lambda: (busy(), torch.cuda.synchronize(), check())) - base
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (rank, idle, queued, after))
    if rank == 0:
        print(f"== idle_latency: {torch.cuda.get_device_name()} x{dist.get_world_size()}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; busy work {base:.2f} ms")
        print("rank  check on an idle GPU ms  queued during the work ms  issued after it ms")
        for r, i, q, a in rows:
            print(f"{r:4d} {i:24.3f} {q:26.3f} {a:19.3f}")
        _timer_slack()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
