"""The quantizing kernels of every format (_formats.py) on one device, next to a plain copy
of the bytes they read (the BF16 source), measured in the same run:
  quantize   the whole-piece kernel (a receiver's quantize after the BF16 landed, a sender's
             staged quantize), 2-D and swizzled scales;
  pack       the fused sender-side pack boxes (data boxes + scale boxes into staging), one
             box-kernel launch, as a refit's pack runs them.
Each row: time, GB/s of bytes read + written, and the copy's time over the kernel's (1.0:
the kernel reads its source as fast as a copy of it runs).

    python benchmarks/formats_kernel_bench.py [--rows 8192 --cols 14336] [--formats nvfp4]
    python benchmarks/formats_kernel_bench.py --tiny          # CPU twins, a check of the script
On a GPU the copy is a device-to-device copy (cudaMemcpy) of the source's bytes; on a CPU,
the CPU twins against torch's copy.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _formats import FORMATS, bytes_read

from reshard_ext import _C
from tests._boxes import table


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


def box_runner(rows: list[tuple], cuda: bool) -> Callable[[], None]:
    blob = table(rows)
    if not cuda:
        return lambda: _C.copy_boxes_cpu(blob)
    tbl = _C.DeviceBoxTable(blob, 0)
    mem = torch.empty(max(tbl.nbytes, 1), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    tbl.upload(mem.data_ptr(), stream)

    def launch(mem: torch.Tensor = mem) -> None:  # the uploaded table lives in mem
        tbl.launch(torch.cuda.current_stream().cuda_stream)

    return launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="[256, 1024] on the CPU, 3 iterations")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny and hasattr(_C, "DeviceBoxTable")
    if args.tiny:
        args.rows, args.cols, args.iters = 256, 1024, 3
    dev = torch.device("cuda" if cuda else "cpu")
    m, k = args.rows, args.cols
    src = torch.randn(m, k, device=dev).to(torch.bfloat16)
    copy_to = torch.empty_like(src)
    t_copy = timed(lambda: copy_to.copy_(src), args.iters, cuda)
    read = bytes_read(src)
    where = torch.cuda.get_device_name() if cuda else "CPU (the C++ twins)"
    print(f"formats_kernel_bench [{m}, {k}] BF16 on {where}: copy of the {read / 1e6:.1f} MB source "
          f"{t_copy * 1e3:.3f} ms, {2 * read / t_copy / 1e9:.0f} GB/s (read + written)")
    print(f"{'format':>7} {'kernel':>18} {'ms':>8} {'GB/s':>6} {'copy/kernel':>11}")
    for name in args.formats.split(","):
        fmt = FORMATS[name]
        rows, outs = fmt.pack_boxes(src)
        written = sum(o.numel() * o.element_size() for o in outs[:2])  # data and block scales
        for layout in ("2d", "swizzled"):
            t = timed(fmt.quantize(src, layout), args.iters, cuda)
            print(f"{name:>7} {'quantize ' + layout:>18} {t * 1e3:>8.3f} {(read + written) / t / 1e9:>6.0f} "
                  f"{t_copy / t:>11.2f}")
        t = timed(box_runner(rows, cuda), args.iters, cuda)
        print(f"{name:>7} {'pack boxes':>18} {t * 1e3:>8.3f} {(read + written) / t / 1e9:>6.0f} {t_copy / t:>11.2f}")
        del outs


if __name__ == "__main__":
    main()
