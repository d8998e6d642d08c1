"""Codecs: the Python side of the fused conversions the box kernels run (csrc/kernels/codecs/).

A codec module wraps its kernels and binds its pieces (the TensorRefs whose boxes carry its
codec id and parameters); the transform that decides which tensors convert, and where,
lives beside the other transforms (rx.MXFP8: reshard_ext/mxfp8.py). What the kernels know of
each codec id (its Traits record in C++) reads here as `traits(name)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import _C
from ..errors import ReshardError


@dataclass(frozen=True)
class Traits:
    """One codec id's record (csrc/kernels/codecs/registry.h)."""

    id: int
    name: str
    grain: int  # the planner's cut grain of a tensor whose boxes carry the id (Transform.last_dim_grain)
    item_elems: int
    item_bytes: int
    digest: bool  # the id is also a receiver digest kind (Transform.receiver_codec)


TRAITS: dict[str, Traits] = {t["name"]: Traits(**t) for t in _C.codec_traits()}


def traits(name: str) -> Traits:
    """The record of codec `name` (e.g. "mxfp8")."""
    return TRAITS[name]


def rows_view(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, cols, row_stride) when t is [..., K] with unit last stride and leading dims
    that flatten to one stride (the whole-piece kernels' view); None otherwise."""
    if t.dim() == 0:
        return None
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    if cols > 1 and t.stride(-1) != 1:
        return None
    if t.dim() == 1 or rows <= 1:
        return rows, cols, max(cols, 1)
    lead = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    row_stride = lead[-1][1]
    expect = row_stride
    for s, st in reversed(lead):
        if st != expect:
            return None
        expect = st * s
    return rows, cols, row_stride


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of t's device, as the kernels take it."""
    return torch.cuda.current_stream(t.device).cuda_stream


def check_pair(what: str, data: torch.Tensor, local: tuple[int, ...], scale: torch.Tensor,
               scale_dtypes: tuple[torch.dtype, ...], scale_numel: int, scale_name: str) -> None:
    """A block-scaled destination's (data, scale) buffers: contiguous E4M3 (or uint8) data of
    the local shape's size, contiguous scales of `scale_numel` elements, one device; else
    ReshardError that starts with `what` (the format and the tensor)."""
    problems = []
    n = math.prod(local)
    if data.dtype not in (torch.float8_e4m3fn, torch.uint8) or not data.is_contiguous() or data.numel() != n:
        problems.append(f"data must be a contiguous float8_e4m3fn (or uint8) tensor of {n} elements (local shape "
                        f"{local}), got {data.dtype} {tuple(data.shape)}")
    if scale.dtype not in scale_dtypes or not scale.is_contiguous() or scale.numel() != scale_numel:
        kinds = " (or ".join(str(d).removeprefix("torch.") for d in scale_dtypes) + ")" * (len(scale_dtypes) - 1)
        problems.append(f"{scale_name} must be a contiguous {kinds} tensor of {scale_numel} elements, got "
                        f"{scale.dtype} {tuple(scale.shape)}")
    if data.device != scale.device:
        problems.append(f"data on {data.device} but {scale_name} on {scale.device}")
    if problems:
        raise ReshardError(f"{what}: " + "; ".join(problems))
