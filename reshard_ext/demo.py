"""`python -m reshard_ext demo`: a Llama-shaped model refit from TP2xPP2 to TP4 on 4 local
CPU processes (gloo), every destination element checked against the source."""
from __future__ import annotations

import datetime
import queue
import socket
import statistics
import sys
import time
import traceback
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def _global(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _refit(rank: int, world: int, port: int, timeout_s: float, fail_rank: int) -> tuple:
    import reshard_ext as rx
    from reshard_ext.synthetic import TINY_LLAMA, Parallel, model_layouts

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if rank == fail_rank:
        raise RuntimeError(f"injected failure on rank {rank} (demo --fail-rank)")
    src_layouts = model_layouts(TINY_LLAMA, Parallel(tp=2, pp=2))
    dst_layouts = model_layouts(TINY_LLAMA, Parallel(tp=4))
    src: dict[str, Any] = {}
    dst: dict[str, tuple[torch.Tensor, rx.Layout]] = {}
    logical = {}
    for name, layout in src_layouts.items():
        g = logical[name] = _global(name, layout.shape, layout.dtype)
        if rank in layout.mesh:
            src[name] = (layout.local_part(g, rank), layout)
    for name, layout in dst_layouts.items():
        if rank in layout.mesh:
            shape = layout.local_shape(rank)
            assert shape is not None  # rank is in the mesh
            dst[name] = (torch.full(shape, float("nan"), dtype=layout.dtype), layout)

    t0 = time.perf_counter()
    plan = rx.plan(src, dst, options=rx.Options(timeout=timeout_s))
    plan_s = time.perf_counter() - t0
    times = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        rx.execute(plan)
        times.append(time.perf_counter() - t0)
    wrong = []
    for n, (t, lay) in dst.items():
        want = lay.local_part(logical[n], rank)
        assert want is not None  # rank is in the mesh
        if not torch.equal(t.view(torch.int16), want.view(torch.int16)):
            wrong.append(n)
    row = (rank, len(src), len(dst), sum(plan.num_ops), plan.bytes_sent, plan_s, statistics.median(times[1:]), wrong)
    dist.destroy_process_group()
    return row


def _worker(rank: int, world: int, port: int, timeout_s: float, fail_rank: int, results: Any) -> None:
    try:
        results.put(("ok", rank, _refit(rank, world, port, timeout_s, fail_rank)))
    except BaseException:  # noqa: BLE001 - the parent prints it and fails at once
        results.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _collect(procs: list, results: Any, world: int, timeout_s: float) -> tuple[list, list[tuple[int, str]]]:
    """Rows of every rank, or the first failures: a worker's error (or death) ends the wait
    at once instead of after the whole timeout."""
    rows: dict[int, tuple] = {}
    errors: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    while len(rows) < world and not errors:
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in rows]
            if dead:
                try:  # its traceback may still be in flight
                    kind, rank, payload = results.get(timeout=2.0)
                except queue.Empty:
                    errors = [(r, f"worker exited with code {code} and no error message") for r, code in dead]
                    break
            elif time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(rows))
                errors = [(r, f"no result within {timeout_s:g} s") for r in missing]
                break
            else:
                continue
        if kind == "ok":
            rows[rank] = payload
        else:
            errors.append((rank, payload))
    return [rows[r] for r in sorted(rows)], errors


def main(world: int = WORLD, timeout_s: float = 300.0, fail_rank: int = -1) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, fail_rank, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows, errors = _collect(procs, results, world, timeout_s)
    if errors:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        rank, text = errors[0]
        print(f"reshard_ext demo FAILED: rank {rank}:\n{text}", file=sys.stderr)
        return 1
    for p in procs:
        p.join()
    print("reshard_ext demo: Llama-shaped bf16 model "
          "(4 layers, hidden 256, GQA 8/2, fused QKV blocks, gate/up stride 2)")
    print(f"refit TP2 x PP2 -> TP4 on {world} CPU processes (gloo)\n")
    print(f"{'rank':>4} {'src':>4} {'dst':>4} {'boxes':>6} {'sent MB':>8} {'plan ms':>8} {'refit ms':>9} "
          f"{'GB/s':>6}  check")
    ok = True
    for rank, ns, nd, boxes, sent, plan_s, refit_s, wrong in rows:
        ok &= not wrong
        gbs = sent / refit_s / 1e9 if refit_s > 0 else 0.0
        status = "ok" if not wrong else f"WRONG: {wrong[:3]}"
        print(f"{rank:4d} {ns:4d} {nd:4d} {boxes:6d} {sent / 1e6:8.2f} {1e3 * plan_s:8.1f} {1e3 * refit_s:9.2f} "
              f"{gbs:6.2f}  {status}")
    total = sum(r[4] for r in rows)
    slowest = max(r[6] for r in rows)
    print(f"\nall ranks: {total / 1e6:.2f} MB across processes, refit {1e3 * slowest:.2f} ms "
          f"(slowest rank), every destination element {'matches' if ok else 'DOES NOT match'} the source")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
