"""Ceilings of the CPU data path between two processes of one host: gloo's TCP loopback (the
CPU transport's link between hosts) against the transport's shared-memory rings (_C.HostRing:
the sender copies into a ring of slots in the receiver's segment, the receiver copies out), and
one process's memcpy of the same bytes.

Each case moves --mb MiB of fp32 from rank 0 to rank 1 ("one way") and, where named "both
ways", from each rank to the other at once; medians of --iters, wall time of the slower rank.

    python benchmarks/cpu_link_bench.py [--mb 256] [--iters 5] [--slot-kb 128] [--slots 4]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import free_port


def _worker(rank: int, port: int, args: argparse.Namespace, out) -> None:
    from reshard_ext import _C

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    ring = _C.HostRing(rank, [0, 1], args.slots, args.slot_kb << 10)
    names: list = [None, None]
    dist.all_gather_object(names, ring.name)
    ring.attach(1 - rank, names[1 - rank])
    token = [0]
    n = args.mb << 18  # fp32 elements
    src = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    want = torch.randn(n, generator=torch.Generator().manual_seed(1 - rank))  # what the peer sends
    dst = torch.zeros(n)
    peer = 1 - rank

    def gloo(both: bool) -> None:
        works = []
        if rank == 0 or both:
            works.append(dist.isend(src, peer))
        if rank == 1 or both:
            works.append(dist.irecv(dst, peer))
        for w in works:
            w.wait()

    def shm(both: bool) -> None:
        token[0] += 1
        ring.begin(token[0], [(peer, src.data_ptr(), src.nbytes)] if rank == 0 or both else [],
                   [(peer, dst.data_ptr(), dst.nbytes)] if rank == 1 or both else [])
        while not ring.poll(1.0):
            pass
        ring.end()

    def memcpy(both: bool) -> None:
        dst.copy_(src)

    cases = [("gloo send/recv", gloo), ("shared-memory rings", shm), ("memcpy, one process", memcpy)]
    rows = []
    for name, fn in cases:
        for both in (False, True):
            if fn is memcpy and both:
                continue
            times = []
            for _ in range(args.iters + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn(both)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            if fn is not memcpy and (rank == 1 or both):
                assert torch.equal(dst, want), f"{name}: the received bytes differ"
            rows.append((f"{name}{', both ways' if both else ''}", statistics.median(times[1:])))
            dst.zero_()
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--slot-kb", type=int, default=128)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(_worker, args=(port, args, out), nprocs=2)
    rows = out.get()
    nbytes = args.mb << 20
    print(f"# {args.mb} MiB per direction, ring {args.slots} x {args.slot_kb} KiB, medians of {args.iters}")
    for name, t in rows:
        print(f"{name:32s} {t * 1e3:9.1f} ms  {nbytes / t / 1e9:6.2f} GB/s per direction")


if __name__ == "__main__":
    main()
