"""A Hugging Face ``transformers`` model as plan entries under its checkpoint names.

The names are those of the model's HF checkpoint (`adapters.hf_names`), which are not
always the names of its parameters: ``transformers`` 5 keeps some MoE experts stacked
and fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
and converts the checkpoint's per-expert tensors on load, through its conversion mapping.
This adapter runs the reverse of that mapping (what ``save_pretrained`` runs,
``transformers.core_model_loading.revert_weight_conversion``) once on shape-only (meta)
tensors, recording which view of which parameter each checkpoint tensor is (chunk,
split, unbind, squeeze, transpose, narrow, select; ``contiguous`` keeps the view), and
applies those views to the parameter itself: a refit writes straight into the stacked
parameter, nothing is copied. A checkpoint tensor the mapping builds by another op (a
concatenation of several parameters, an interleave) raises, naming it.

Parameters that are DTensors (FSDP2, TP: an FSDP2-wrapped ``transformers`` model keeps
the model's names) are described by their DTensor layouts and viewed the same way
(`reshard_ext.views`); other parameters are whole on this rank (TP1), replicated over
`ranks`. Grouped-query q/k/v take the grouped shapes of `hf_names.grouped_qkv`, from
the model's config. Tied parameters appear once, under their first name (as in a
checkpoint saved with ``tie_word_embeddings``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import groups, views
from ..errors import ReshardError
from ..layout import Layout, Mesh, Replicate
from . import Entries, dtensor, named_tensors
from .hf_names import attention_shape, grouped_qkv

Op = tuple  # ("narrow", dim, start, length) | ("squeeze", dim) | ("transpose", dim0, dim1)
Origin = tuple[str, tuple[Op, ...]]  # (parameter name, view ops from it)

_KEEP = {torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.detach}  # same elements: the view stands


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a ``transformers`` PreTrainedModel (without importing it)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


class _Recorder(TorchFunctionMode):
    """Follows meta tensors through torch calls: the origin (parameter, view ops) of
    every tensor derived from a parameter by supported view ops; `failed` says why other
    derived tensors have none."""

    def __init__(self, params: dict[str, torch.Tensor]):
        super().__init__()
        self.origin: dict[int, Origin] = {id(t): (n, ()) for n, t in params.items()}
        self.failed: dict[int, str] = {}
        self.keep: list[Any] = list(params.values())  # ids stay unique while recording

    def _note(self, t: Any, origin: Origin | None, why: str = "") -> None:
        if isinstance(t, torch.Tensor):
            self.keep.append(t)
            if origin is not None:
                self.origin[id(t)] = origin
            else:
                self.failed[id(t)] = why

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        origin = self.origin.get(id(src)) if src is not None else None
        if origin is not None and func in _KEEP:
            return src
        out = func(*args, **kwargs)
        if origin is None:
            inputs = [a for a in (args[0] if args and isinstance(args[0], (list, tuple)) else args)
                      if isinstance(a, torch.Tensor) and id(a) in self.origin]
            if inputs:  # e.g. torch.cat of parameters: not a view of one
                why = f"{getattr(func, '__name__', func)} of {[self.origin[id(a)][0] for a in inputs]}"
                for t in out if isinstance(out, (list, tuple)) else [out]:
                    self._note(t, None, why)
            return out
        assert src is not None
        name, ops = origin
        pieces = list(out) if isinstance(out, (list, tuple)) else [out]
        steps = _steps(func, src, args, kwargs, pieces)
        for t, step in zip(pieces, steps if steps is not None else [None] * len(pieces)):
            if step is None:
                self._note(t, None, f"{getattr(func, '__name__', func)} of '{name}'")
            else:
                self._note(t, (name, ops + tuple(step)))
        return out


def _arg(args: Sequence[Any], kwargs: Any, i: int, key: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(key, default)


def _steps(func: Any, src: torch.Tensor, args: Sequence[Any], kwargs: Any,
           pieces: list[Any]) -> list[list[Op]] | None:
    """The view ops from `src` to each of `pieces`, or None for an op this cannot follow."""
    name = getattr(func, "__name__", "")
    nd = src.dim()
    if name in ("chunk", "split", "tensor_split"):
        dim = _arg(args, kwargs, 2, "dim", 0) % nd
        steps, start = [], 0
        for p in pieces:
            steps.append([("narrow", dim, start, p.shape[dim])])
            start += p.shape[dim]
        return steps
    if name == "unbind":
        dim = _arg(args, kwargs, 1, "dim", 0) % nd
        return [[("narrow", dim, i, 1), ("squeeze", dim)] for i in range(len(pieces))]
    if name == "squeeze":
        dims = _arg(args, kwargs, 1, "dim", None)
        dims = range(nd) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
        ones = sorted({d % nd for d in dims if src.shape[d] == 1}, reverse=True)
        return [[("squeeze", d) for d in ones]]
    if name in ("transpose", "swapaxes"):
        d0 = _arg(args, kwargs, 1, "dim0", _arg(args, kwargs, 1, "axis0", 0))
        d1 = _arg(args, kwargs, 2, "dim1", _arg(args, kwargs, 2, "axis1", 1))
        return [[("transpose", d0 % nd, d1 % nd)]]
    if name == "t" and nd == 2:
        return [[("transpose", 0, 1)]]
    if name in ("narrow", "select"):
        dim = _arg(args, kwargs, 1, "dim", 0) % nd
        start = _arg(args, kwargs, 2, "start" if name == "narrow" else "index", 0) % src.shape[dim]
        if name == "select":
            return [[("narrow", dim, start, 1), ("squeeze", dim)]]
        return [[("narrow", dim, start, _arg(args, kwargs, 3, "length", 0))]]
    if name in ("view", "reshape") and tuple(pieces[0].shape) == tuple(src.shape):
        return [[]]
    return None


def checkpoint_views(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Origin]:
    """Checkpoint name -> (parameter name, view ops), from the model's conversion mapping
    (identity where ``transformers`` has none, e.g. before 5.0). `tensors`: the model's
    named tensors (only their global shapes and dtypes are read)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {n: (n, ()) for n in tensors}
    metas = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in tensors.items()}
    recorder = _Recorder(metas)
    with torch.no_grad(), recorder:
        converted = revert_weight_conversion(model, dict(metas))  # type: ignore[arg-type]
    out: dict[str, Origin] = {}
    for ckpt, t in converted.items():
        t = t[0] if isinstance(t, list) else t
        origin = recorder.origin.get(id(t))
        if origin is None:
            why = recorder.failed.get(id(t), "an op outside the traced set")
            raise ReshardError(f"checkpoint tensor '{ckpt}' of {type(model).__name__}: transformers builds it by "
                               f"{why}, which is not a view of one parameter; describe this model with plan entries")
        out[ckpt] = origin
    return out


def _apply(piece: views.Piece, layout: Layout, rank: int, ops: tuple[Op, ...],
           name: str) -> tuple[views.Piece, Layout]:
    for op in ops:
        if op[0] == "narrow":
            piece, layout = views.narrow(piece, layout, rank, op[1], op[2], op[3], name)
        elif op[0] == "squeeze":
            piece, layout = views.squeeze(piece, layout, rank, op[1], name)
        else:
            piece, layout = views.transpose(piece, layout, rank, op[1], op[2], name)
    return piece, layout


def entries(model: nn.Module, *, group: Any = None, rank_offset: int = 0,
            ranks: Sequence[int] | None = None) -> Entries:
    """Plan entries of a ``transformers`` model under its checkpoint names.

    group: the refit process group (mesh ranks are its ranks); rank_offset: added to this
    process's rank when the model lives in another world than `group`'s numbering.
    ranks: the refit-group ranks that each hold a whole copy of this model (replicas), the
    same list on each of them; default: this rank alone. DTensor parameters bring their
    own meshes.
    """
    me = groups.rank() + rank_offset if rank_offset else groups.rank(group)
    mesh = Mesh(list(ranks) if ranks is not None else [me])
    if me not in mesh:
        raise ReshardError(f"ranks={list(mesh.ranks)} does not hold this rank ({me}), which passes the model")
    pieces: dict[str, tuple[views.Piece, Layout]] = {}
    globals_: dict[str, torch.Tensor] = {}
    for name, t in named_tensors(model):
        data = t.data if isinstance(t, nn.Parameter) else t
        if isinstance(data, dtensor.DTensor):
            pieces[name] = (data.to_local(), dtensor.layout_of(data, name, group=group, rank_offset=rank_offset))
        else:
            pieces[name] = (data.detach(), Layout(tuple(data.shape), data.dtype, mesh, [Replicate()]))
        globals_[name] = data
    out: Entries = {}
    for ckpt, (param, ops) in checkpoint_views(model, globals_).items():
        piece, layout = _apply(*pieces[param], me, ops, ckpt)
        if piece is not None:
            out[ckpt] = (piece, layout)
    shape = attention_shape(getattr(model, "config", None))
    return out if shape is None else grouped_qkv(out, me, **shape)


__all__ = ["entries", "checkpoint_views", "is_transformers_model"]
