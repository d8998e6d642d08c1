"""Separately launched jobs for tests of rx.connect: process sets that each have their own
torch.distributed world (or none), as a trainer and an inference engine do.

`run_jobs(jobs, fn, *args)` runs the module-level function
`fn(job, local_rank, sizes, *args)` in every process of every job and returns the
results in job order, then local rank order. `jobs` is a tuple of (ranks, backend):
backend "gloo" or "nccl" gives that job its own world (init_process_group on a port of
its own), None gives it no world at all. Processes are started once per `jobs` (forked
from the server of _dist.worker_context, which imported torch) and reused (starting torch
costs seconds on a 2-core machine); where there is CUDA, process
i of the whole set uses device i. A process that raises makes run_jobs raise with its
traceback; one that does not answer within the timeout (a hang) fails the test.
"""
from __future__ import annotations

import atexit
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

from _dist import RankFailure, adopt_environment, free_port, stop_workers, worker_context


def _worker(job: int, local: int, sizes: tuple[int, ...], backend: str | None, port: int, device: int,
            env: dict[str, str], inq, outq) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    adopt_environment(env)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    torch.set_num_threads(1)
    if torch.cuda.is_available() and device < torch.cuda.device_count():  # a job without a world may use CUDA too
        torch.cuda.set_device(device)
    if backend is not None:
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=local, world_size=sizes[job],
                                    timeout=datetime.timedelta(seconds=120))
        except BaseException as e:  # the free port was taken meanwhile: the test fails (rare)
            outq.put((job, local, "err", f"init_process_group: {type(e).__name__}: {e}"))
            return
    outq.put((job, local, "ready", None))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args = item
        try:
            outq.put((job, local, "ok", fn(job, local, sizes, *args)))
        except BaseException as e:  # report everything, keep serving
            outq.put((job, local, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    if backend is not None:
        dist.destroy_process_group()


class Jobs:
    def __init__(self, jobs: tuple[tuple[int, str | None], ...]):
        ctx = worker_context()
        self.sizes = tuple(n for n, _ in jobs)
        self.outq = ctx.Queue()
        self.inqs: dict[tuple[int, int], Any] = {}
        self.procs = []
        device = 0
        for j, (n, backend) in enumerate(jobs):
            port = free_port() if backend is not None else 0
            for r in range(n):
                q = ctx.Queue()
                self.inqs[(j, r)] = q
                self.procs.append(ctx.Process(target=_worker, args=(j, r, self.sizes, backend, port, device,
                                                                    dict(os.environ), q, self.outq), daemon=True))
                device += 1
        for p in self.procs:
            p.start()
        self._collect(180, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[tuple[int, int], Any] = {}
        errors: dict[tuple[int, int], str] = {}
        while len(results) + len(errors) < len(self.inqs):
            try:
                job, local, kind, payload = self.outq.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(self.inqs) - set(results) - set(errors))
                self.close()
                raise RankFailure(f"(job, rank) {missing} did not answer within {timeout}s ({what}: hang)") from None
            if kind == "err":
                errors[(job, local)] = payload
            else:
                results[(job, local)] = payload
        if errors:
            first = min(errors)
            raise RankFailure(f"job {first[0]} rank {first[1]} raised:\n{errors[first]}")
        return [results[k] for k in sorted(results)]

    def run(self, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
        for q in self.inqs.values():
            q.put((fn, args))
        return self._collect(timeout, getattr(fn, "__name__", "call"))

    def close(self) -> None:
        stop_workers(self.inqs.values(), self.procs)
        for key, jobs in list(_POOLS.items()):
            if jobs is self:
                del _POOLS[key]


_POOLS: dict[tuple, Jobs] = {}


def run_jobs(jobs: tuple[tuple[int, str | None], ...], fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Runs fn(job, local_rank, sizes, *args) in every process of every job (see the module doc)."""
    pool = _POOLS.get(jobs)
    if pool is not None and not all(p.is_alive() for p in pool.procs):
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[jobs] = Jobs(jobs)
    return pool.run(fn, *args, timeout=timeout)


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
