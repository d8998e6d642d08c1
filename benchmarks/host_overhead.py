"""Host (CPU) time that `rx.execute` spends per call for a plan with many tensors.

The descriptor tables are built and uploaded at plan time, so execute costs a few
launches and one grouped NCCL call per batch, whatever the tensor count. Also reported:
the check that no bound tensor's storage was replaced or resized (`storage check`), which
reads every bound tensor once per execute: one C++ loop over torch's C data_ptr reader, or
with `--tensor-data-ptr` the fallback used where torch has none (Tensor.data_ptr per tensor).
Both are CPU time of the calling thread; the check's line also gives its wall time (helper
threads share the check of a large plan: RESHARD_EXT_CHECK_THREADS) and its wall time per bound
tensor (every src and dst piece: 20,000 for the default 10,000 tensors). `all threads` is the
process's CPU time per execute (the caller, the check's helpers, the header channel's worker
and torch's own threads). `--device cpu` runs it over gloo (there the execute time includes
the copies themselves, which run on the calling thread). `cold`: the check's wall time after
`--cold-mb` of other memory traffic, as between the executes of a real refit (the warm loop
keeps every bound tensor's TensorImpl in cache).

    torchrun --nproc-per-node 2 benchmarks/host_overhead.py [--tensors 10000] [--device cpu] [--tensor-data-ptr]
        [--profile] [--phases] [--emulate-cuda] [--cold-mb 512]

--phases: each rank's execute split into phases, caller CPU and wall time per phase (medians;
the timers add about a microsecond per phase): the storage check, the header exchange (over
gloo: posting it to the channel's worker, the first pack that runs while the headers travel,
the wait for the peers' headers; between processes of one host: `header mailbox`, the
shared-memory exchange less that first pack), the executor's run (CUDA: posts, launches, NCCL and the host wait for the
transfers), the transport's run (CPU: the copies and their messages) and the rest (Python
bookkeeping, what no phase covers).
--emulate-cuda (with --device cpu): the CUDA transport's Python (CudaTransport.run, the header
exchange over the real channel, the storage check) over CPU tensors, its executor a recorder
that launches and moves nothing: the CUDA path's host overhead without a GPU.
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Shard

PHASES = ("check", "header post", "first pack", "header wait", "header mailbox", "executor.run", "transport.run")


class Phases:
    """Caller CPU and wall time per phase of the current execute (patched around the
    functions that make each phase; nested phases are subtracted from transport.run)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.rows: list[tuple[dict[str, float], dict[str, float]]] = []  # per execute: (cpu, wall)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w0
        return run

    def execute(self, plan: Any) -> None:
        self.cpu, self.wall = {}, {}
        c0, w0 = time.thread_time(), time.perf_counter()
        rx.execute(plan)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        for d in (self.cpu, self.wall):  # the phases inside the transport's run are its own
            if "transport.run" in d:
                d["transport.run"] -= sum(d.get(k, 0.0) for k in PHASES[1:6])
        self.cpu["rest"] = cpu - sum(v for k, v in self.cpu.items() if not k.startswith("  run:"))
        self.wall["rest"] = wall - sum(v for k, v in self.wall.items() if not k.startswith("  run:"))
        self.cpu["execute"], self.wall["execute"] = cpu, wall
        self.rows.append((self.cpu, self.wall))

    def install(self, plan: Any) -> None:
        """Times the phases of `plan`'s executes (its transport's run, check and headers)."""
        from reshard_ext.transports import channel, cpu, cuda

        plan._local_problem = self.timed("check", plan._local_problem)
        transport = plan.transport
        transport.run = self.timed("transport.run", transport.run)
        exchange = channel.exchange_headers

        def headers(chan: Any, peers: Any, session: Any, batches: int, before_wait: Any = None) -> Any:
            # the channel's submit and wait of the headers only (the CPU transport's data use them too);
            # the shared-memory exchange of a host's peers less the first pack it runs meanwhile
            chan.submit, chan.wait = self.timed("header post", chan.submit), self.timed("header wait", chan.wait)
            chan.mailbox_exchange = self.timed("header mailbox", chan.mailbox_exchange)
            first_pack = None if before_wait is None else self.timed("first pack", before_wait)
            c0, w0 = self.cpu.get("first pack", 0.0), self.wall.get("first pack", 0.0)
            try:
                return exchange(chan, peers, session, batches, first_pack)
            finally:
                del chan.submit, chan.wait, chan.mailbox_exchange
                if "header mailbox" in self.cpu:
                    self.cpu["header mailbox"] -= self.cpu.get("first pack", 0.0) - c0
                    self.wall["header mailbox"] -= self.wall.get("first pack", 0.0) - w0
        cpu.exchange_headers = cuda.exchange_headers = headers
        self._exchange = exchange
        if hasattr(transport, "executor"):
            transport.executor = _TimedExecutor(transport.executor, self)

    def uninstall(self) -> None:
        """Puts back the transports' header exchange."""
        from reshard_ext.transports import cpu, cuda

        cpu.exchange_headers = cuda.exchange_headers = self._exchange

    def report(self, rank: int) -> str:
        names = [n for n in PHASES[:6] + ("  run: posts", "  run: host wait") + PHASES[6:] + ("rest", "execute")
                 if any(n in c for c, _ in self.rows)]
        parts = []
        for n in names:
            c = statistics.median(row[0].get(n, 0.0) for row in self.rows)
            w = statistics.median(row[1].get(n, 0.0) for row in self.rows)
            if n.startswith("  run:"):  # inside executor.run
                parts.append(f"(of which {n[7:]} {1e3 * c:.3f}/{1e3 * w:.3f})")
            else:
                parts.append(f"{n} {1e3 * c:.3f}/{1e3 * w:.3f}")
        return f"host_overhead --phases: rank {rank}, ms CPU/wall (medians of {len(self.rows)}): " + ", ".join(parts)


class _TimedExecutor:
    """The executor, its run timed (its other calls pass through); where the executor can,
    its time split into posting and launching, and the host wait for the transfers."""

    def __init__(self, ex: Any, phases: Phases):
        self._ex = ex
        timed = phases.timed("executor.run", ex.run)
        if not hasattr(ex, "set_time_host"):
            self.run = timed
            return
        ex.set_time_host(True)

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return timed(*args, **kwargs)
            finally:
                post_cpu, post_wall, wait_cpu, wait_wall = ex.last_run_times
                phases.cpu["  run: posts"], phases.wall["  run: posts"] = post_cpu, post_wall
                phases.cpu["  run: host wait"], phases.wall["  run: host wait"] = wait_cpu, wait_wall
        self.run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ex, name)


def emulate_cuda() -> None:
    """--emulate-cuda: rx.plan's transport becomes a CudaTransport over CPU tensors whose
    executor records instead of launching (see the module doc)."""
    from reshard_ext import _C, execution
    from reshard_ext.transports import cuda
    from reshard_ext.transports.channel import channel_of

    class Comm:  # what CudaTransport.run reads of an NCCL communicator
        timeout = 1.0
        usable = True

    class Emulated(cuda.CudaTransport):
        def __init__(self, group: Any, options: rx.Options):  # noqa: D107 - CudaTransport's, without CUDA
            self.group, self.channel, self.peers, self.staging_bytes = group, channel_of(group), [], 0
            self.comm, self.nccl, self.p2p, self.trace, self.register = Comm(), False, None, False, False
            self.direct_bytes = options.resolved_direct_bytes("cuda")
            self.log = _C.RecordingLog()
            self.executor = _C.Executor.recording(self.log)
            self.executor.set_transport(_C.RecordingTransport(self.log))
            self.last_timeline, self._registered, self._read = "", [], None

        def bind(self, tables: Any) -> tuple[list[int], list[int]]:
            self.recv = [torch.empty(max(1, tables.recv_buffer_bytes), dtype=torch.uint8) for _ in range(2)]
            self.send = [torch.empty(max(1, tables.send_buffer_bytes), dtype=torch.uint8) for _ in range(2)]
            return [t.data_ptr() for t in self.send], [t.data_ptr() for t in self.recv]

        def prepare(self, tables: Any) -> None:
            self.executor.prepare(tables, True, 0, [(t.data_ptr(), t.numel()) for t in self.recv])
            self._tables, self.peers = tables, list(self.executor.peers)

        def run(self, tables: Any, session: Any, verify: bool = False) -> Any:
            self.log.clear()  # the recorder's log would grow by every execute
            return super().run(tables, session, verify)

    cuda._RAW_STREAM = lambda device: 1  # the recorder's main stream
    torch._C._cuda_getDevice = lambda: 0

    def make(backend: str, device: Any, group: Any, options: rx.Options, register: bool = False) -> tuple[str, Any]:
        return "nccl", Emulated(group, options)
    execution._make_transport = make


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tensor-data-ptr", action="store_true", help="the storage check's fallback path")
    ap.add_argument("--profile", action="store_true", help="rank 0's top functions of executes without the check")
    ap.add_argument("--phases", action="store_true", help="each rank's execute time per phase")
    ap.add_argument("--emulate-cuda", action="store_true", help="with --device cpu: the CUDA transport's Python")
    ap.add_argument("--cold-mb", type=int, default=512,
                    help="the storage check also timed after touching this much other memory (0: not)")
    args = ap.parse_args()
    if args.emulate_cuda:
        if args.device != "cpu":
            ap.error("--emulate-cuda needs --device cpu")
        emulate_cuda()
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
    device = "cuda" if args.device == "cuda" else "cpu"
    label = "cpu, CUDA transport emulated" if args.emulate_cuda else args.device
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    ranks = list(range(world))
    src, dst = {}, {}
    for i in range(args.tensors):
        shape = (64, 32)
        s = Layout(shape, torch.bfloat16, Mesh(ranks), [Shard(0)])
        d = Layout(shape, torch.bfloat16, Mesh(ranks[::-1]), [Shard(1)])
        src[f"t{i}"] = (torch.randn(s.local_shape(rank), device=device).to(torch.bfloat16), s)
        dst[f"t{i}"] = (torch.empty(d.local_shape(rank), device=device, dtype=torch.bfloat16), d)
    t0 = time.perf_counter()
    plan = rx.plan(src, dst)
    plan_s = time.perf_counter() - t0
    for _ in range(3):
        rx.execute(plan)
    sync()
    cpu, every, check, check_wall = [], [], [], []
    for _ in range(args.iters):
        t0, p0 = time.thread_time(), time.process_time()
        rx.execute(plan)
        cpu.append(time.thread_time() - t0)
        every.append(time.process_time() - p0)
        sync()
        t0, w0 = time.thread_time(), time.perf_counter()
        if hasattr(plan, "_watch"):  # absent before the storage check existed
            plan._watch.changed(rank)
        check.append(time.thread_time() - t0)
        check_wall.append(time.perf_counter() - w0)
    watch = getattr(plan, "_watch", None)
    # The check again after other memory traffic, as between the executes of a real refit:
    # the warm loop above keeps every TensorImpl in cache.
    flush = torch.empty(args.cold_mb << 20, dtype=torch.uint8) if args.cold_mb and watch is not None else None
    cold = []
    for _ in range(args.iters if flush is not None else 0):
        flush.add_(1)
        w0 = time.perf_counter()
        watch.changed(rank)
        cold.append(time.perf_counter() - w0)
    how = "none" if watch is None else "C++ loop" if getattr(watch, "fast", None) is not None else "Tensor.data_ptr"
    bound = len(watch.tensors) if watch is not None else 0
    threads = plan.options.resolved_check_threads() if hasattr(plan.options, "resolved_check_threads") else 1
    how += f", {threads} threads" if threads > 1 else ""
    row = (rank, plan_s, cpu, sum(plan.num_ops), check, how, bound, check_wall, every, cold)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        for r, ps, c, ops, chk, how, bound, chk_wall, ev, cold_wall in rows:
            each = f", {1e9 * statistics.median(chk_wall) / bound:.1f} ns per bound tensor" if bound else ""
            if cold_wall:
                each += (f"; cold (after {args.cold_mb} MB of other memory traffic) "
                         f"{1e3 * statistics.median(cold_wall):.3f} ms, "
                         f"{1e9 * statistics.median(cold_wall) / bound:.1f} ns per bound tensor")
            print(f"host_overhead ({label}): rank {r}: {args.tensors} tensors, {ops} boxes, plan {ps:.2f} s, "
                  f"execute CPU time {1e3 * statistics.median(c):.3f} ms (min {1e3 * min(c):.3f}; all threads "
                  f"{1e3 * statistics.median(ev):.3f}), of which "
                  f"storage check ({how}) {1e3 * statistics.median(chk):.3f} ms (min {1e3 * min(chk):.3f}), wall "
                  f"{1e3 * statistics.median(chk_wall):.3f} ms{each}; medians of {args.iters}")
    if args.phases:
        for check_storage in (True, False):
            timed = rx.plan(src, dst, options=rx.Options(check_storage=check_storage))
            phases = Phases()
            phases.install(timed)
            for _ in range(3):
                phases.execute(timed)
                sync()
            phases.rows.clear()
            for _ in range(args.iters):
                phases.execute(timed)
                sync()
            phases.uninstall()
            lines = [None] * world
            dist.all_gather_object(lines, phases.report(rank) + ("" if check_storage else " (check_storage=False)"))
            if rank == 0:
                print("\n".join(lines))
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
