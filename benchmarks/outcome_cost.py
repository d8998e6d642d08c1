"""What the outcome exchange that ends every execute costs (transports/outcome.py: one
answer on every rank): a small refit in which every rank sends to and receives from every
other one, executed in blocks that alternate, in the same processes, between the real
execute and one whose outcome exchange is replaced by a local "every rank landed" (what
the execute did before the exchange existed). Reports per rank the median host time of
rx.execute of each kind and the difference (the slowest rank's median difference too).

    python benchmarks/outcome_cost.py [--device cpu|cuda] [--world N] [--backend auto] [--blocks 20] [--per 50]
    python benchmarks/outcome_cost.py --case TP2->TP1 --blocks 10 --per 1   # cpu_refit_bench.py's refit
    # 2 GPUs: python benchmarks/outcome_cost.py --device cuda --world 2 --backend nccl   (and direct, nvshmem)
    # 1 GPU:  python benchmarks/outcome_cost.py --device cuda --world 2 --backend direct --share-gpu
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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    import reshard_ext as rx
    from reshard_ext.transports import outcome

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count() if args.share_gpu else rank)
    torch.set_num_threads(1)
    group_backend = "nccl" if cuda and not args.share_gpu else "gloo"
    dist.init_process_group(group_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    dev = "cuda" if cuda else "cpu"
    if args.case:  # benchmarks/cpu_refit_bench.py's refit: a GPT of 335M fp32 parameters
        from cpu_refit_bench import CASES

        from reshard_ext.synthetic import GPT_335M, Parallel, model_layouts

        src_tp, dst_tp = CASES[args.case]
        src_all = model_layouts(GPT_335M, Parallel(tp=src_tp, dp=world // src_tp), torch.float32)
        dst_all = model_layouts(GPT_335M, Parallel(tp=dst_tp, dp=world // dst_tp), torch.float32)
        src = {n: (torch.randn(l.local_shape(rank), device=dev), l) for n, l in src_all.items() if rank in l.mesh}
        dsts = {n: (torch.zeros(l.local_shape(rank), device=dev), l) for n, l in dst_all.items() if rank in l.mesh}
        plan = rx.plan(src, dsts, backend=args.backend)
        dst, dst_l, g = None, None, None
    else:
        shape = (args.rows * world, args.cols * world)
        src_l = rx.Layout(shape, torch.float32, rx.Mesh(list(range(world))), [rx.Shard(0)])
        dst_l = rx.Layout(shape, torch.float32, rx.Mesh(list(range(world))), [rx.Shard(1)])
        g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        dst = torch.zeros(dst_l.local_shape(rank), device=dev)
        plan = rx.plan({"w": (src_l.local_part(g, rank).to(dev), src_l)}, {"w": (dst, dst_l)}, backend=args.backend)
    real = outcome.agree

    def landed(channel, session, part):  # noqa: ANN001, ANN202 - the stand-in: every rank landed, no exchange
        return outcome.Outcome({r: outcome.OK for r in range(channel.size)}, [], session.seq)

    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(args.blocks + 2):  # the first two blocks warm up
        with_outcome = block % 2 == 0
        outcome.agree = real if with_outcome else landed
        dist.barrier()
        for _ in range(args.per):
            t0 = time.perf_counter()
            rx.execute(plan)
            if block >= 2:
                times[with_outcome].append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.synchronize()
    outcome.agree = real
    ok = dst is None or torch.equal(dst.cpu(), dst_l.local_part(g, rank))
    rows = [None] * world
    dist.all_gather_object(rows, (rank, statistics.median(times[True]), statistics.median(times[False]), ok,
                                  plan.backend))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--blocks", type=int, default=20, help="blocks of each kind, alternating")
    ap.add_argument("--per", type=int, default=50, help="executes per block")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--case", choices=("TP2->TP1", "TP2->TP4"), help="cpu_refit_bench.py's refit instead (--world 4)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="CUDA ranks share the GPUs there are (rank r on GPU r mod count; the group over gloo): "
                         "backend direct only; the exchange's host cost, not a 2-GPU execute's")
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=1800)
    for p in procs:
        p.join()
    for rank, on, off, ok, backend in rows:
        print(f"rank {rank} [{backend}]: execute {1e6 * on:8.1f} us with the outcome, {1e6 * off:8.1f} us without "
              f"({1e6 * (on - off):+7.1f} us){'' if ok else '  WRONG DATA'}")
    slowest_on, slowest_off = max(r[1] for r in rows), max(r[2] for r in rows)
    print(f"slowest rank: {1e6 * slowest_on:.1f} vs {1e6 * slowest_off:.1f} us "
          f"({1e6 * (slowest_on - slowest_off):+.1f} us per execute, {100 * (slowest_on / slowest_off - 1):+.2f}%)")


if __name__ == "__main__":
    main()
