"""The low-precision formats a refit can write (docs/guide/formats.md), as one table that benchmarks
and tools iterate: how to make each format's transform and the destination buffers an engine
holds for a local piece, and what it puts on the wire. A format adds one entry here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .transforms import Transform


@dataclass(frozen=True)
class Format:
    name: str
    summary: str
    wheres: tuple[str, ...]
    # keyword -> its choices, the default first (besides params and where)
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # transform(params, where=..., **options)
    transform: Callable[..., Transform] = Transform
    # buffers(local data shape, device, **options): the destination tuple of one piece
    buffers: Callable[..., tuple[torch.Tensor, ...]] = tuple
    # wire_bytes(where): bytes on the wire per element of a BF16 tensor of whole blocks
    wire_bytes: Callable[[str], float] = float
    # bytes per tensor and destination rank besides its elements (NVFP4's float32 tensor scale)
    tensor_bytes: int = 0

    def make(self, params: Iterable[str] | Callable[[str], bool], where: str, **options: Any) -> Transform:
        return self.transform(params, where=where, **options)


def _mxfp8_buffers(local: tuple[int, ...], device: Any, scale_layout: str = "2d", **_: Any) -> tuple[torch.Tensor, ...]:
    from .mxfp8 import scale_numel

    return (torch.empty(local, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(scale_numel(local, scale_layout), dtype=torch.uint8, device=device))


def _fp8block_buffers(local: tuple[int, ...], device: Any, **_: Any) -> tuple[torch.Tensor, ...]:
    from .codecs.fp8block import scale_shape

    return (torch.empty(local, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(scale_shape(local), dtype=torch.float32, device=device))


def _nvfp4_buffers(local: tuple[int, ...], device: Any, scale_layout: str = "2d", **_: Any) -> tuple[torch.Tensor, ...]:
    from .codecs.nvfp4 import scale_numel

    return (torch.empty(local[:-1] + (local[-1] // 2,), dtype=torch.uint8, device=device),
            torch.empty(scale_numel(local, scale_layout), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((), dtype=torch.float32, device=device))


def _formats() -> dict[str, Format]:
    from . import fp8block, mxfp8, nvfp4

    return {
        "mxfp8": Format("mxfp8", "E4M3 + E8M0 scale per 32 elements of the last dim (OCP MX)", ("receiver", "sender"),
                        {"scale_layout": ("2d", "swizzled"), "rounding": ("ceil", "floor")}, mxfp8.MXFP8,
                        _mxfp8_buffers, mxfp8.wire_bytes_per_element),
        "fp8block": Format("fp8block", "E4M3 + FP32 scale_inv per 128x128 block (DeepSeek-V3, TE blockwise)",
                           ("receiver", "sender"), {"scales": ("fp32", "pow2")}, fp8block.FP8Block,
                           _fp8block_buffers, fp8block.wire_bytes_per_element),
        "nvfp4": Format("nvfp4", "E2M1 + E4M3 scale per 16 elements of the last dim + FP32 per tensor (NVIDIA)",
                        ("receiver", "sender"), {"scale_layout": ("2d", "swizzled")}, nvfp4.NVFP4, _nvfp4_buffers,
                        nvfp4.wire_bytes_per_element, tensor_bytes=4),
    }


FORMATS: dict[str, Format] = _formats()


def get(name: str) -> Format:
    """The format `name` (one of FORMATS)."""
    return FORMATS[name]
