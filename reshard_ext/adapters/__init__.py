"""Module adapters (DESIGN section 5): turn an nn.Module into plan entries
``{global_name: (local_tensor, rx.Layout)}`` with rank-independent global names.

- ``megatron``: Megatron-Core conventions read from parameters, modules and ``pg_collection``.
- ``dtensor``: DTensor parameters (FSDP2, tensor parallel), including ``_StridedShard``.

A name map (``NameMap``) renames entries for engines whose names differ from the trainer's;
returning None drops the entry.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import ReshardError
from ..layout import Layout

Entries = dict[str, tuple[torch.Tensor, Layout]]
NameMap = Callable[[str], str | None]


def regex_name_map(rules: Sequence[tuple[str, str]], keep_unmatched: bool = True) -> NameMap:
    """A NameMap from (pattern, replacement) rules; the first full match wins.

    e.g. ``[(r"decoder\\.layers\\.(\\d+)\\.self_attention\\.linear_qkv\\.(.*)",
    r"model.layers.\\1.self_attn.qkv_proj.\\2")]``.
    """
    compiled = [(re.compile(p), r) for p, r in rules]

    def rename(name: str) -> str | None:
        for pattern, repl in compiled:
            if pattern.fullmatch(name):
                return pattern.sub(repl, name)
        return name if keep_unmatched else None

    return rename


def apply_name_map(entries: Mapping[str, tuple[torch.Tensor, Layout]], name_map: NameMap | None) -> Entries:
    if name_map is None:
        return dict(entries)
    out: Entries = {}
    for name, item in entries.items():
        new = name_map(name)
        if new is None:
            continue
        if new in out:
            raise ReshardError(f"name map sends two tensors to '{new}' (one of them '{name}')")
        out[new] = item
    return out


from . import dtensor, megatron  # noqa: E402  (submodules use the types above)

__all__ = ["Entries", "NameMap", "regex_name_map", "apply_name_map", "megatron", "dtensor"]


def __dir__() -> list[str]:
    """The public names (tab completion, help()), not re, torch and the typing names used here."""
    return sorted(__all__)
