"""Codecs: the Python side of the fused conversions the box kernels run (csrc/kernels/codecs/).

A codec module wraps its kernels and binds its pieces (the TensorRefs whose boxes carry its
codec id and parameters); the transform that decides which tensors convert, and where,
lives beside the other transforms (rx.MXFP8: reshard_ext/mxfp8.py). What the kernels know of
each codec id (its Traits record in C++) reads here as `traits(name)`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _C


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
