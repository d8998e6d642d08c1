"""Real process groups for tests: a pool of worker processes per (world size, backend).

Starting torch in a fresh process costs seconds on a 2-core machine, so each pool is
started once per test session and reused, and its workers are forked from a server that
imported torch once (`worker_context`): `run_ranks(n, fn, *args)` runs the
module-level function `fn(rank, world_size, *args)` on every rank of an n-process group
(gloo on CPU, nccl on GPU) and returns the per-rank results. A rank that raises makes
`run_ranks` raise with that rank's traceback; a rank that does not answer within the
timeout (a hang) fails the test and the pool is torn down. RX_TEST_DUMP_AFTER=S makes a
rank print every thread's stack to stderr when one call runs S seconds (run pytest with -s).

RX_TEST_SHARED_GPU=1 lets the GPU tests of n ranks run on fewer GPUs: rank r of an "nccl"
pool takes GPU r mod count, and the group runs over gloo (NCCL refuses two ranks on one GPU).
Two processes on one GPU is a real deployment (a trainer and an engine collocated in separate
processes) and the direct transport serves it; the cases whose backend needs a GPU per rank
(NCCL, NVSHMEM, torch point-to-point) skip themselves there (`own_gpus`).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    pass


_PRELOAD = ["torch", "torch.distributed"]
SHARED_GPU = os.environ.get("RX_TEST_SHARED_GPU") == "1"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_for(ranks: int) -> bool:
    """Whether `ranks` GPU ranks can run here: that many GPUs, or RX_TEST_SHARED_GPU=1 and one."""
    n = gpu_count()
    return n >= ranks or (SHARED_GPU and n >= 1)


def own_gpus(backend: str = "nccl") -> None:
    """Skips the calling test where ranks share GPUs (RX_TEST_SHARED_GPU=1) and `backend`
    needs a GPU per rank: NCCL refuses two ranks on one GPU, and NVSHMEM and torch's
    point-to-point go through it or their own per-GPU setup; the direct transport does not."""
    if SHARED_GPU and backend not in ("direct", "auto"):
        import pytest

        pytest.skip(f"backend {backend!r} between the ranks needs a GPU per rank (RX_TEST_SHARED_GPU=1)")


def gpu_of(rank: int) -> Any:
    """The GPU of test rank `rank` (as the pool's workers set it)."""
    import torch

    return torch.device("cuda", rank % max(gpu_count(), 1) if SHARED_GPU else rank)


def worker_context():
    """The start method of test ranks: a forkserver that imported torch once, so a rank costs
    a fork, not a fresh interpreter importing torch; the server never touches CUDA, so a
    forked rank may. Each rank takes the caller's environment as it is when the rank starts
    (`adopt_environment`), as a spawned one would."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def adopt_environment(env: dict[str, str]) -> None:
    """The starting process's environment in this rank (the forkserver's is from when it started)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def _worker(rank: int, world: int, port: int, backend: str, env: dict[str, str], inq, outq) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    adopt_environment(env)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(gpu_of(rank))
    group_backend = "gloo" if SHARED_GPU else backend
    try:
        dist.init_process_group(
            group_backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
            **({"device_id": gpu_of(rank)} if group_backend == "nccl" else {}),
        )
    except BaseException as e:  # e.g. the free port was taken meanwhile: the pool retries on another
        outq.put((rank, "init_err", f"{type(e).__name__}: {e}"))
        return
    outq.put((rank, "ready", None))
    dump_after = float(os.environ.get("RX_TEST_DUMP_AFTER", "0"))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args = item
        if dump_after:  # every thread's stack on stderr if the call runs that long (a hang's where)
            faulthandler.dump_traceback_later(dump_after)
        try:
            outq.put((rank, "ok", fn(rank, world, *args)))
        except BaseException as e:  # report everything, keep serving
            outq.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int, backend: str):
        ctx = worker_context()
        self.world = world
        self.backend = backend
        for attempt in range(3):
            self.inqs = [ctx.Queue() for _ in range(world)]
            self.outq = ctx.Queue()
            port = free_port()  # another process can take it before rank 0 listens: then retry
            self.procs = [
                ctx.Process(target=_worker, args=(r, world, port, backend, dict(os.environ), self.inqs[r], self.outq),
                            daemon=True)
                for r in range(world)
            ]
            for p in self.procs:
                p.start()
            failed = self._ready(timeout=180)
            if failed is None:
                return
            self.close()
            if "EADDRINUSE" not in failed and "address already in use" not in failed or attempt == 2:
                raise RankFailure(f"the process group did not start: {failed}")

    def _ready(self, timeout: float) -> str | None:
        """None once every rank joined the group; else the first rank's init error (the
        others may wait on it, so this does not wait for them)."""
        ready: set[int] = set()
        while len(ready) < self.world:
            try:
                rank, kind, payload = self.outq.get(timeout=timeout)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.world)) - ready)
                raise RankFailure(f"ranks {missing} did not join the group within {timeout}s (hang)") from None
            if kind == "init_err":
                return f"rank {rank}: {payload}"
            ready.add(rank)
        return None

    def _collect(self, timeout: float, dies: tuple[int, ...] = ()) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            dead = {r for r in dies if not self.procs[r].is_alive()}
            if dead and len(results) + len(errors) + len(dead - set(results) - set(errors)) >= self.world:
                for r in dead:
                    results.setdefault(r, None)
                break
            try:
                rank, kind, payload = self.outq.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.0))
                                                    if dies else timeout)
            except queue.Empty:
                if dies and time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(self.world)) - set(results) - set(errors))
                self.close()
                raise RankFailure(f"ranks {missing} did not answer within {timeout}s (hang)") from None
            if kind == "err":
                errors[rank] = payload
            else:
                results[rank] = payload
        if errors:
            # the first to arrive, not the lowest rank: that one is often a peer's timeout
            first = next(iter(errors))
            others = "".join(f"\nrank {r} also raised: {e.strip().splitlines()[-1] if e.strip() else e}"
                             for r, e in errors.items() if r != first)
            raise RankFailure(f"rank {first} raised first:\n{errors[first]}{others}")
        return [results[r] for r in range(self.world)]

    def run(self, fn: Callable, *args, timeout: float = 300, dies: tuple[int, ...] = ()) -> list[Any]:
        for q in self.inqs:
            q.put((fn, args))
        return self._collect(timeout, dies)

    def close(self) -> None:
        stop_workers(self.inqs, self.procs)
        if _POOLS.get((self.world, self.backend)) is self:
            del _POOLS[(self.world, self.backend)]


def stop_workers(inqs, procs) -> None:
    """Asks each worker to end (None on its queue); kills those still alive after 5 s."""
    for q in inqs:
        try:
            q.put(None)
        except Exception:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


_POOLS: dict[tuple[int, str], Pool] = {}


def run_ranks(world: int, fn: Callable, *args, backend: str = "gloo", timeout: float = 300,
              dies: tuple[int, ...] = ()) -> list[Any]:
    """Runs fn(rank, world, *args) on every rank of a `world`-process group. dies: ranks that
    kill themselves on the way (their result is None; the pool is torn down after)."""
    key = (world, backend)
    pool = _POOLS.get(key)
    if pool is not None and not all(p.is_alive() for p in pool.procs):
        pool.close()  # a rank died: its group is gone for the others too
        pool = None
    if pool is None:
        pool = _POOLS[key] = Pool(world, backend)
    try:
        return pool.run(fn, *args, timeout=timeout, dies=dies)
    finally:
        if dies:
            pool.close()


def close_pool(world: int, backend: str = "gloo") -> None:
    """Ends the pool of `world` ranks (a test that leaves its group unusable)."""
    pool = _POOLS.get((world, backend))
    if pool is not None:
        pool.close()


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
