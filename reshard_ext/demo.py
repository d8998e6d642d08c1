"""`python -m reshard_ext demo`: a Llama-shaped model refit from TP2xPP2 to TP4 on 4 local
CPU processes (gloo), every destination element checked against the source."""
from __future__ import annotations

import datetime
import socket
import statistics
import time
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _global(name: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _worker(rank: int, port: int, results) -> None:
    import reshard_ext as rx
    from reshard_ext.synthetic import TINY_LLAMA, Parallel, model_layouts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    src_layouts = model_layouts(TINY_LLAMA, Parallel(tp=2, pp=2))
    dst_layouts = model_layouts(TINY_LLAMA, Parallel(tp=4))
    src, dst, logical = {}, {}, {}
    for name, layout in src_layouts.items():
        g = logical[name] = _global(name, layout.shape, layout.dtype)
        if rank in layout.mesh:
            src[name] = (layout.local_part(g, rank), layout)
    for name, layout in dst_layouts.items():
        if rank in layout.mesh:
            dst[name] = (torch.full(layout.local_shape(rank), float("nan"), dtype=layout.dtype), layout)

    t0 = time.perf_counter()
    plan = rx.plan(src, dst)
    plan_s = time.perf_counter() - t0
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        rx.execute(plan)
        times.append(time.perf_counter() - t0)
    wrong = [n for n, (t, l) in dst.items() if not torch.equal(t.view(torch.int16), l.local_part(logical[n], rank).view(torch.int16))]
    row = (rank, len(src), len(dst), sum(plan.num_ops), plan.bytes_sent, plan_s, statistics.median(times[1:]), wrong)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, row)
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = results.get(timeout=300)
    for p in procs:
        p.join()
    print("reshard_ext demo: Llama-shaped bf16 model (4 layers, hidden 256, GQA 8/2, fused QKV blocks, gate/up stride 2)")
    print("refit TP2 x PP2 -> TP4 on 4 CPU processes (gloo)\n")
    print(f"{'rank':>4} {'src':>4} {'dst':>4} {'boxes':>6} {'sent MB':>8} {'plan ms':>8} {'refit ms':>9} {'GB/s':>6}  check")
    ok = True
    for rank, ns, nd, boxes, sent, plan_s, refit_s, wrong in rows:
        ok &= not wrong
        gbs = sent / refit_s / 1e9 if refit_s > 0 else 0.0
        status = "ok" if not wrong else f"WRONG: {wrong[:3]}"
        print(f"{rank:4d} {ns:4d} {nd:4d} {boxes:6d} {sent / 1e6:8.2f} {1e3 * plan_s:8.1f} {1e3 * refit_s:9.2f} {gbs:6.2f}  {status}")
    total = sum(r[4] for r in rows)
    slowest = max(r[6] for r in rows)
    print(f"\nall ranks: {total / 1e6:.2f} MB across processes, refit {1e3 * slowest:.2f} ms "
          f"(slowest rank), every destination element {'matches' if ok else 'DOES NOT match'} the source")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
