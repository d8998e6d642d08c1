"""The low-precision formats the benchmarks compare (formats_bench.py, formats_kernel_bench.py):
per format, its transform, a destination of one local piece, and its sender-side pack boxes
(the fused quantize kernels). A new format is one entry in FORMATS."""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reshard_ext as rx  # noqa: E402
from reshard_ext import _C  # noqa: E402
from reshard_ext.codecs import mxfp8 as mx  # noqa: E402
from reshard_ext.codecs import nvfp4 as nv  # noqa: E402
from reshard_ext.layout import code_of  # noqa: E402

U8, I32, BF16 = code_of(torch.uint8), code_of(torch.int32), code_of(torch.bfloat16)


@dataclass(frozen=True)
class Format:
    name: str
    # (dst names, where, scale layout) -> the transform
    transform: Callable[[list[str], str, str], Any]
    # (local shape, scale layout, device) -> the destination target of one piece
    destination: Callable[[tuple[int, ...], str, torch.device], Any]
    # (BF16 source [M, K] on a device, scale layout) -> a function running the whole-piece quantize
    quantize: Callable[[torch.Tensor, str], Callable[[], None]]
    # (BF16 source [M, K]) -> (pack box rows: data, then scales, into fresh staging; staging bytes)
    pack_boxes: Callable[[torch.Tensor], tuple[list[tuple], list[torch.Tensor]]]


def _mx_destination(local: tuple[int, ...], layout: str, dev: torch.device) -> Any:
    return (torch.empty(local, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(mx.scale_numel(local, layout), dtype=torch.uint8, device=dev))


def _mx_quantize(src: torch.Tensor, layout: str) -> Callable[[], None]:
    data = torch.empty(src.numel(), dtype=torch.uint8, device=src.device)
    scale = torch.empty(mx.scale_numel(tuple(src.shape), layout), dtype=torch.uint8, device=src.device)
    return lambda: mx.quantize(src, data, scale, layout, "ceil")


def _mx_pack(src: torch.Tensor) -> tuple[list[tuple], list[torch.Tensor]]:
    m, k = src.shape
    data = torch.empty(m * k, dtype=torch.uint8, device=src.device)
    scale = torch.empty(m * (k // 32), dtype=torch.uint8, device=src.device)
    rows = [(src.data_ptr(), data.data_ptr(), (m, k), (k, 1), (k, 1), BF16, U8, int(_C.BOX_MX_DATA), 0),
            (src.data_ptr(), scale.data_ptr(), (m, k // 32), (k, 32), (k // 32, 1), BF16, U8, int(_C.BOX_MX_SCALE), 0)]
    return rows, [data, scale]


def _nv_destination(local: tuple[int, ...], layout: str, dev: torch.device) -> Any:
    return (torch.empty(local[:-1] + (local[-1] // 2,), dtype=torch.uint8, device=dev),
            torch.empty(nv.scale_numel(local, layout), dtype=torch.float8_e4m3fn, device=dev),
            torch.empty((), dtype=torch.float32, device=dev))


def _cell(src: torch.Tensor) -> torch.Tensor:
    return src.abs().max().float().view(torch.int32).view(1).clone()


def _nv_quantize(src: torch.Tensor, layout: str) -> Callable[[], None]:
    m, k = src.shape
    cell = _cell(src)
    data = torch.empty(m * k // 2, dtype=torch.uint8, device=src.device)
    scale = torch.empty(nv.scale_numel((m, k), layout), dtype=torch.uint8, device=src.device)
    tscale = torch.empty(1, dtype=torch.float32, device=src.device)
    return lambda: nv.quantize(src, cell, data, scale, tscale, layout)


def _nv_pack(src: torch.Tensor) -> tuple[list[tuple], list[torch.Tensor]]:
    m, k = src.shape
    w = k // 2  # int32 words of BF16 pairs per row
    cell = _cell(src)
    data = torch.empty(m * w, dtype=torch.uint8, device=src.device)
    scale = torch.empty(m * (k // 16), dtype=torch.uint8, device=src.device)
    rows = [(src.data_ptr(), data.data_ptr(), (m, w), (w, 1), (w, 1), I32, U8, int(_C.BOX_NV_DATA), cell.data_ptr()),
            (src.data_ptr(), scale.data_ptr(), (m, k // 16), (w, 8), (k // 16, 1), I32, U8, int(_C.BOX_NV_SCALE),
             cell.data_ptr())]
    return rows, [data, scale, cell]


FORMATS: dict[str, Format] = {
    "mxfp8": Format("mxfp8", lambda names, where, layout: rx.MXFP8(names, scale_layout=layout, where=where),
                    _mx_destination, _mx_quantize, _mx_pack),
    "nvfp4": Format("nvfp4", lambda names, where, layout: rx.NVFP4(names, scale_layout=layout, where=where),
                    _nv_destination, _nv_quantize, _nv_pack),
}


def bytes_read(src: torch.Tensor) -> int:
    return math.prod(src.shape) * src.element_size()
