"""Ceilings of the CPU data path between two processes of one host: what gloo's TCP loopback
moves (the CPU transport's link today) against a copy through shared memory (what a
shared-memory transport would do: the sender copies into a ring of slots, the receiver out
of it, each slot handed over by a flag), and one process's memcpy of the same bytes.

Each case moves --mb MiB of fp32 from rank 0 to rank 1 ("one way") and, where named "both
ways", from each rank to the other at once; medians of --iters, wall time of the slower rank.

    python benchmarks/cpu_link_bench.py [--mb 256] [--iters 5] [--slot-kb 1024] [--slots 4]
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


def _ring_move(src: torch.Tensor | None, out_ring: tuple | None, dst: torch.Tensor | None,
               in_ring: tuple | None) -> None:
    """Copies src through out_ring and dst out of in_ring, each chunk as soon as its slot
    allows (one loop, so that two ranks sending to each other both progress). Slot k takes
    chunk i when its flag is 0, then the flag becomes i + 1 (x86 keeps the data's stores
    before the flag's); the receiver copies it out and clears the flag."""
    sides = []
    if src is not None and out_ring is not None:
        sides.append((True, src.view(torch.uint8).view(-1), *out_ring))
    if dst is not None and in_ring is not None:
        sides.append((False, dst.view(torch.uint8).view(-1), *in_ring))
    done = [0] * len(sides)
    while True:
        busy = False
        for j, (send, flat, ring, flags) in enumerate(sides):
            slots, slot = ring.shape
            at = done[j] * slot
            if at >= flat.numel():
                continue
            busy = True
            k = done[j] % slots
            if int(flags[k]) != (0 if send else done[j] + 1):
                continue
            n = min(slot, flat.numel() - at)
            if send:
                ring[k, :n].copy_(flat[at:at + n])
                flags[k] = done[j] + 1
            else:
                flat[at:at + n].copy_(ring[k, :n])
                flags[k] = 0
            done[j] += 1
        if not busy:
            return


def _worker(rank: int, port: int, args: argparse.Namespace, rings: list, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
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

    def shm(both: bool) -> None:  # rings[r]: the ring into rank r
        sends, recvs = rank == 0 or both, rank == 1 or both
        _ring_move(src if sends else None, rings[peer] if sends else None, dst if recvs else None,
                   rings[rank] if recvs else None)

    def memcpy(both: bool) -> None:
        dst.copy_(src)

    cases = [("gloo send/recv", gloo), ("shared-memory ring", shm), ("memcpy, one process", memcpy)]
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
    p.add_argument("--slot-kb", type=int, default=1024)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    port = free_port()
    rings = [(torch.zeros(args.slots, args.slot_kb << 10, dtype=torch.uint8).share_memory_(),
              torch.zeros(args.slots, dtype=torch.int64).share_memory_()) for _ in range(2)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(_worker, args=(port, args, rings, out), nprocs=2)
    rows = out.get()
    nbytes = args.mb << 20
    print(f"# {args.mb} MiB per direction, ring {args.slots} x {args.slot_kb} KiB, medians of {args.iters}")
    for name, t in rows:
        print(f"{name:32s} {t * 1e3:9.1f} ms  {nbytes / t / 1e9:6.2f} GB/s per direction")


if __name__ == "__main__":
    main()
