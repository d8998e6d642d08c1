"""Throughput of the CUDA MXFP8 quantize kernel (one GPU) next to a device-to-device copy
of the same bytes, measured in the same run.

    python benchmarks/mxfp8_kernel_bench.py [--rows 8192 --cols 14336]
Bytes counted: BF16 read (2/elem) + E4M3 written (1/elem) + scales (1/32 per elem); the
D2D copy moves the same number of bytes (read + write counted alike).
"""
from __future__ import annotations

import argparse

import torch
from _common import cuda_time

from reshard_ext import mxfp8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=14336)
    args = ap.parse_args()
    m, k = args.rows, args.cols
    src = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    data = torch.empty(m * k, dtype=torch.uint8, device="cuda")
    moved = m * k * (2 + 1) + m * mxfp8.scale_cols(k)
    half = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(half)
    t_copy = cuda_time(lambda: other.copy_(half), 20, warmup=3)
    print(f"MXFP8 quantize [{m}, {k}] on {torch.cuda.get_device_name()}; D2D copy of the same bytes: "
          f"{t_copy * 1e3:.3f} ms, {moved / t_copy / 1e9:.0f} GB/s")
    for layout in ("2d", "swizzled"):
        scale = torch.empty(mxfp8.scale_numel((m, k), layout), dtype=torch.uint8, device="cuda")
        t = cuda_time(lambda scale=scale, layout=layout: mxfp8.quantize(src, data, scale, layout, "ceil"), 20, warmup=3)
        print(f"  {layout:>8}: {t * 1e3:.3f} ms, {moved / t / 1e9:.0f} GB/s, {t_copy / t:.2f} of the copy rate")


if __name__ == "__main__":
    main()
