"""How fast the CPU digest reads memory that is not in cache: `rx.verify` of a one-rank plan
that copies one tensor (--mb MB each side, fp32 and bf16), timed after other memory traffic
evicted both (as a verified refit hashes what the kernel's socket copies left in DRAM).
One process, one thread; prints the median and best of --iters runs and the best's GB/s.
Then the same plan's copy, plain (the twin's copy) and as a verified refit's pack and unpack
run it (the copy pass: copied and hashed; and with its stores past the cache, as the unpack
and the rings' receiver run it), each cold, alternating: what hashing adds to a copy.

    python benchmarks/cpu_digest_bench.py [--mb 512] [--iters 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _common import free_port

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    bytes_ = args.mb << 20
    evict = torch.zeros(4 * bytes_ // 4)  # twice both tensors' bytes
    for dtype in (torch.float32, torch.bfloat16):
        n = bytes_ // torch.empty(0, dtype=dtype).element_size()
        layout = Layout((n,), dtype, Mesh([0]), [Replicate()])
        plan = rx.plan({"w": (torch.randn(n).to(dtype), layout)}, {"w": (torch.empty(n, dtype=dtype), layout)})
        rx.execute(plan)
        times = []
        for _ in range(args.iters):
            evict.add_(1.0)
            start = time.perf_counter()
            rx.verify(plan)
            times.append(time.perf_counter() - start)
        name = str(dtype).split(".")[-1]
        print(f"{name:>8}: rx.verify of 2 x {args.mb} MB, cold: median {1e3 * statistics.median(times):.1f} ms, "
              f"best {1e3 * min(times):.1f} ms = {2 * bytes_ / min(times) / 1e9:.1f} GB/s", flush=True)
        boxes = plan.tables.copy_boxes()
        runs: dict[str, list[float]] = {"copy": [], "copy pass": [], "cold": []}
        for _ in range(args.iters):
            for what in runs:
                evict.add_(1.0)
                start = time.perf_counter()
                if what == "copy":
                    _C.copy_boxes_cpu(boxes)
                else:
                    _C.digest_boxes_cpu(boxes, int(_C.PASS_COPY if what == "copy pass" else _C.PASS_COPY_COLD))
                runs[what].append(time.perf_counter() - start)
        plain, hashed, cold = (statistics.median(runs[k]) for k in runs)
        print(f"{name:>8}: copy of {args.mb} MB, cold: plain median {1e3 * plain:.1f} ms "
              f"({bytes_ / plain / 1e9:.1f} GB/s), copy pass (copied and hashed) {1e3 * hashed:.1f} ms, "
              f"cost {100 * (hashed / plain - 1):+.1f}%; its stores past the cache (PASS_COPY_COLD) "
              f"{1e3 * cold:.1f} ms, cost {100 * (cold / plain - 1):+.1f}%", flush=True)
        del plan
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
