"""CPU refit speed and memory: a GPT-shaped fp32 model of ~335M parameters (24 layers,
hidden 1024, FFN 4096, vocab 32000, tied embeddings) refit on 4 gloo processes,
collocated: TP2 x DP2 -> TP1 x DP4 and TP2 x DP2 -> TP4.

Reports per warm refit the slowest rank's time (median of --iters) and host memory:
peak RSS of each process minus its RSS once both models are allocated (the transient
memory the refit itself costs), summed over processes. --verify adds a column: the same
refit with rx.execute(plan, verify=True), timed in the same processes (alternating with
the plain refit), and its cost relative to the plain one.

--link gloo moves the bytes between the processes over gloo instead of the shared-memory
rings (rx.Tuning(host_ring=False)).

--phases (with --verify): where each rank's time goes, plain against verified: wall ms per
execute (medians) in the steps of the CPU transport (pack, unpack, same-rank copies; the
channel worker's ring exchange and the caller's wait for it) and in the verify check.

    python benchmarks/cpu_refit_bench.py [--iters 3] [--max-batch-mb 0] [--verify [--phases]] [--link rings|gloo]
"""
from __future__ import annotations

import argparse
import datetime
import os
import queue
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port

WORLD = 4
CASES = {"TP2->TP1": (2, 1), "TP2->TP4": (2, 4)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Steps:
    """Wall time per step of the current execute, timed by wrapping the functions that make
    each step (the worker thread's ring exchange overlaps the caller's wait for it)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}

    def timed(self, name: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t0
        return run

    def install(self) -> None:
        from reshard_ext import _C, verification
        from reshard_ext.transports import channel

        for m in ("run_pack_cpu", "run_unpack_cpu", "run_copies_cpu"):
            setattr(_C.ExecTables, m, self.timed(m[4:-4], getattr(_C.ExecTables, m)))
        for m in ("run_pack_cpu_verified", "run_unpack_cpu_verified"):
            setattr(_C.ExecTables, m, self.timed(m[4:-13], getattr(_C.ExecTables, m)))
        channel.Channel._ring_exchange = self.timed("ring exchange (worker)", channel.Channel._ring_exchange)
        channel.Channel.wait = self.timed("wait for the worker", channel.Channel.wait)
        verification.check = self.timed("verify check", verification.check)

    def median(self, verify: bool, name: str) -> float:
        rows = self.rows[verify][1:]  # the first (cold) execute left out
        return statistics.median(r.get(name, 0.0) for r in rows) if rows else 0.0


def _worker(rank: int, port: int, case: str, iters: int, max_batch: int, verify: bool, link: str, out,
            phases: bool = False) -> None:
    import reshard_ext as rx
    from reshard_ext.synthetic import GPT_335M, Parallel, model_layouts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    src_tp, dst_tp = CASES[case]
    src_l = model_layouts(GPT_335M, Parallel(tp=src_tp, dp=WORLD // src_tp), torch.float32)
    dst_l = model_layouts(GPT_335M, Parallel(tp=dst_tp, dp=WORLD // dst_tp), torch.float32)
    src = {n: (torch.randn(l.local_shape(rank)), l) for n, l in src_l.items() if rank in l.mesh}
    # zeros, not empty: the destination pages must be resident before the baseline RSS
    dst = {n: (torch.zeros(l.local_shape(rank)), l) for n, l in dst_l.items() if rank in l.mesh}
    model_bytes = sum(t.numel() * 4 for t, _ in list(src.values()) + list(dst.values()))
    base_rss = _rss_bytes()
    dist.barrier()  # plan time should not include waiting for a slower rank's model setup
    t0 = time.perf_counter()
    options = rx.Options(tuning=rx.Tuning(host_ring=link == "rings"))
    plan = rx.plan(src, dst, max_batch_bytes=max_batch or None, options=options)
    plan_s = time.perf_counter() - t0
    steps = _Steps()
    if phases:
        steps.install()
    times: list[float] = []
    verified: list[float] = []
    cpu: dict[bool, list[float]] = {False: [], True: []}  # CPU-seconds of this process (all threads)
    for _ in range(iters + 1):
        for check, into in ((False, times), (True, verified)) if verify else ((False, times),):
            dist.barrier()
            steps.now = {}
            c0, t0 = time.process_time(), time.perf_counter()
            rx.execute(plan, verify=check)
            into.append(time.perf_counter() - t0)
            cpu[check].append(time.process_time() - c0)
            steps.now["execute"] = into[-1]
            steps.rows[check].append(steps.now)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    names = sorted({n for rows_ in steps.rows.values() for r in rows_ for n in r})
    step_rows = [(n, steps.median(False, n), steps.median(True, n)) for n in names] if phases else []
    row = (rank, plan_s, times[1:], plan.bytes_sent, model_bytes, base_rss, peak, verified[1:], cpu[False][1:],
           cpu[True][1:], step_rows)
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run(case: str, iters: int, max_batch: int, verify: bool, link: str, phases: bool = False) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, case, iters, max_batch, verify, link, q, phases))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = None
    while rows is None:  # a worker that died (a raise) must not leave this waiting for ever
        try:
            rows = q.get(timeout=5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a worker failed (exit codes {dead}); see its traceback above") from None
    for p in procs:
        p.join()
    per_iter = [max(r[2][i] for r in rows) for i in range(iters)]
    transient = sum(max(0, r[6] - r[5]) for r in rows)
    models = sum(r[4] for r in rows)
    sent = sum(r[3] for r in rows)
    print(f"{case:9} [{link}] warm refit {statistics.median(per_iter):7.3f} s "
          f"(min {min(per_iter):.3f}, max {max(per_iter):.3f})  "
          f"plan {max(r[1] for r in rows):.2f} s  sent {sent / 1e9:.2f} GB  models {models / 1e9:.2f} GB  "
          f"transient {transient / 1e9:.3f} GB  peak RSS sum {sum(r[6] for r in rows) / 1e9:.2f} GB")
    if verify:
        checked = [max(r[7][i] for r in rows) for i in range(iters)]
        plain, ver = statistics.median(per_iter), statistics.median(checked)
        print(f"{'':9} verify=True {ver:7.3f} s (min {min(checked):.3f}, max {max(checked):.3f})  "
              f"cost {100 * (ver / plain - 1):+.1f}% (median vs median; "
              f"min vs min {100 * (min(checked) / min(per_iter) - 1):+.1f}%)")
        # CPU-seconds summed over the processes: steadier than wall time on a shared machine
        cpu_plain = statistics.median(sum(r[8][i] for r in rows) for i in range(iters))
        cpu_ver = statistics.median(sum(r[9][i] for r in rows) for i in range(iters))
        print(f"{'':9} CPU-seconds per refit (sum of {WORLD} processes, median) {cpu_plain:.3f} -> {cpu_ver:.3f}  "
              f"cost {100 * (cpu_ver / cpu_plain - 1):+.1f}%")
    for r in rows if phases else []:
        for name, plain_s, ver_s in r[10]:
            print(f"{'':9} rank {r[0]} {name:24s} plain {1e3 * plain_s:8.2f} ms  verify=True {1e3 * ver_s:8.2f} ms  "
                  f"({1e3 * (ver_s - plain_s):+.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--max-batch-mb", type=int, default=0, help="rx.plan max_batch_bytes in MiB (0: unbounded)")
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--verify", action="store_true", help="also time rx.execute(plan, verify=True)")
    ap.add_argument("--link", choices=("rings", "gloo"), default="rings",
                    help="how the bytes move between the processes (default: the shared-memory rings)")
    ap.add_argument("--phases", action="store_true",
                    help="with --verify: each rank's wall ms per step, plain against verified")
    args = ap.parse_args()
    if args.phases and not args.verify:
        ap.error("--phases compares plain and verified executes: it needs --verify")
    for case in args.case or list(CASES):
        run(case, args.iters, args.max_batch_mb << 20, args.verify, args.link, args.phases)


if __name__ == "__main__":
    main()
