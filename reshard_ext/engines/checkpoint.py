"""The Hugging Face tensors an engine's loader takes: names, global shapes and dtypes, in
checkpoint order, from a safetensors checkpoint's headers (no tensor data is read), from
a mapping of tensors or (shape, dtype) pairs, or from the checkpoint the engine was
loaded from (its Hugging Face config's ``_name_or_path``).
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ReshardError
from .recording import Specs

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: str | os.PathLike) -> Specs:
    """{name: (shape, dtype)} of one .safetensors file, in the order of its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out: Specs = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ReshardError(f"{path}: tensor '{name}' has dtype {info['dtype']}, which reshard_ext does not read")
        out[name] = (tuple(info["shape"]), dtype)
    return out


def read_checkpoint(path: str | os.PathLike) -> Specs:
    """{name: (shape, dtype)} of a .safetensors file or of every one in a directory
    (sorted by file name, as engines load them)."""
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not files[0].exists():
        raise ReshardError(f"no .safetensors checkpoint at {path}")
    out: Specs = {}
    for f in files:
        out.update(read_header(f))
    return out


def _from_config(model: torch.nn.Module) -> Specs:
    config = getattr(model, "config", None)
    where = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not where:
        raise ReshardError(f"{type(model).__name__}: say which Hugging Face tensors its load_weights takes: "
                           f"weights=<checkpoint directory or .safetensors file> or {{name: tensor or (shape, dtype)}} "
                           f"(its config names no checkpoint)")
    if Path(where).exists():
        return read_checkpoint(where)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(where, allow_patterns=["*.safetensors"], local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not in the local cache, or no huggingface_hub
        raise ReshardError(f"{type(model).__name__}: its checkpoint '{where}' is neither a local path nor in the "
                           f"Hugging Face cache ({type(e).__name__}: {e}); pass weights=") from None
    return read_checkpoint(local)


def specs_of(weights: Any, model: torch.nn.Module | None = None) -> Specs:
    """{name: (shape, dtype)} from `weights`: a checkpoint path, a mapping of tensors or
    (shape, dtype) pairs, an iterable of (name, tensor), or None (the model's checkpoint)."""
    if weights is None:
        if model is None:
            raise ReshardError("weights=None needs the model, to find its checkpoint")
        return _from_config(model)
    if isinstance(weights, (str, os.PathLike)):
        return read_checkpoint(weights)
    items: Iterable[tuple[str, Any]] = weights.items() if isinstance(weights, Mapping) else weights
    out: Specs = {}
    for name, w in items:
        if isinstance(w, torch.Tensor):
            out[name] = (tuple(w.shape), w.dtype)
        elif isinstance(w, tuple) and len(w) == 2 and isinstance(w[1], torch.dtype):
            out[name] = (tuple(int(s) for s in w[0]), w[1])
        else:
            raise ReshardError(f"weights['{name}']: expected a tensor or (shape, dtype), got {type(w).__name__}")
    return out
