"""The quantizing kernels of every format (reshard_ext.formats) on one device, next to a
device-to-device copy of the bytes they read (the BF16 source), measured in the same run.

One rank, one BF16 weight [rows, cols] refitted onto itself (a same-rank copy: no transport),
for each format and side:
  sender    the copy boxes read the source and quantize it on the way (the lanes a sender's
            pack runs; staged formats quantize first, then copy the quantized bytes);
  receiver  the BF16 copy, then the whole-piece quantize of the landed piece;
and the plain BF16 refit of the same weight. Each row: the refit's time (CUDA events around
rx.execute, amax pre-pass included), GB/s of the source bytes read, and the copy's time over
it (1.0: as fast as a D2D copy of the source).

    python benchmarks/formats_kernel_bench.py [--rows 8192 --cols 14336] [--formats nvfp4]
    python benchmarks/formats_kernel_bench.py --tiny          # the CPU twins, a check of the script
    python benchmarks/formats_kernel_bench.py --kernels       # + each row's kernels (torch.profiler)
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import reshard_ext as rx
from reshard_ext.formats import FORMATS


def timed(fn: Callable[[], None], iters: int, cuda: bool) -> float:
    if cuda:
        from _common import cuda_time

        return cuda_time(fn, iters, warmup=3)
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {sorted(FORMATS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="[256, 1024] on the CPU, 3 iterations")
    ap.add_argument("--kernels", action="store_true", help="after each row, its kernels' device time per execute "
                    "(torch.profiler over 5 executes; CUDA only)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if args.tiny:
        args.rows, args.cols, args.iters = 256, 1024, 3
    from _common import free_port

    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        run(args, cuda)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, cuda: bool) -> None:
    dev = torch.device("cuda" if cuda else "cpu")
    m, k = args.rows, args.cols
    lay = rx.Layout((m, k), torch.bfloat16, rx.Mesh([0]), [rx.Replicate()])
    src = torch.randn(m, k, device=dev).to(torch.bfloat16)
    read = src.numel() * src.element_size()
    copy_to = torch.empty_like(src)
    t_copy = timed(lambda: copy_to.copy_(src), args.iters, cuda)
    where = torch.cuda.get_device_name() if cuda else "CPU (the C++ twins)"
    print(f"formats_kernel_bench [{m}, {k}] BF16 on {where}: D2D copy of the {read / 1e6:.1f} MB source "
          f"{t_copy * 1e3:.3f} ms, {read / t_copy / 1e9:.0f} GB/s read")
    print(f"{'format':>8} {'where':>8} {'options':>22} {'ms':>8} {'GB/s read':>9} {'copy/it':>7}")

    def row(fmt: str, side: str, opts: dict[str, str], dst: object, transform: object) -> None:
        plan = rx.plan({"w": (src, lay)}, {"w": (dst, lay)}, transform=transform)
        t = timed(lambda: rx.execute(plan), args.iters, cuda)
        text = ",".join(f"{k}={v}" for k, v in opts.items()) or "-"
        print(f"{fmt:>8} {side:>8} {text:>22} {t * 1e3:>8.3f} {read / t / 1e9:>9.0f} {t_copy / t:>7.2f}")
        if args.kernels and cuda:
            print_kernels(lambda: rx.execute(plan))

    row("bf16", "-", {}, torch.empty_like(src), None)
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        layouts = fmt.options.get("scale_layout", (None,))
        for side in fmt.wheres:
            for layout in layouts:
                opts = {} if layout is None else {"scale_layout": layout}
                row(name, side, opts, fmt.buffers((m, k), dev, **opts), fmt.make(["w"], side, **opts))


def print_kernels(fn: Callable[[], None], runs: int = 5) -> None:
    """Each kernel's device time per call of fn, the longest first (where the time of a row goes)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and not e.key.startswith("cuda")]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:6]:
        name = e.key.replace("(anonymous namespace)::", "").replace("void ", "").split("(")[0]
        print(f"{'':>19} {e.device_time_total / runs:>9.1f} us  x{e.count // runs}  {name[-70:]}")


if __name__ == "__main__":
    main()
