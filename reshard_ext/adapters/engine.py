"""Inference engines as refit destinations (vLLM, SGLang, or any model whose
``load_weights(iterable of (hf_name, tensor))`` loads a Hugging Face checkpoint).

`entries(model, group=..., rank_offset=..., weights=...)` traces the engine's own loader
once on every engine rank (reshard_ext.engines), the engine ranks agree on one layout per
Hugging Face tensor, and the result (`EngineEntries`) is this rank's plan entries: views
into the engine's fused, padded, TP/EP-sharded parameters, so that a refit writes each
rank's slice straight where the loader would put it. Collective over the engine's ranks
(`engine_group`); the trainer side describes its model under Hugging Face names.
Grouped-query q/k/v take adapters.hf_names' grouped shapes when the model's config names
its attention heads (vLLM and SGLang models carry their Hugging Face config), as every
side described under Hugging Face names does.

    dst = rx.adapters.engine.entries(llm_model, group=refit_group, rank_offset=trainer_world)
    plan = rx.plan(src=None, dst=dst, group=refit_group)   # once
    rx.execute(plan); dst.finish()                          # every refit
    # then the engine's post-load step, if any (see reshard_ext.engines)
"""
from __future__ import annotations

import functools
import hashlib
import weakref
from typing import Any, TypeGuard

from torch import nn

from .. import groups
from ..collectives import all_gather_objects
from ..engines.checkpoint import specs_of
from ..engines.entries import EngineEntries, decide
from ..engines.trace import Loader, trace_loader
from ..errors import ReshardError
from .hf_names import attention_shape, grouped_qkv

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_engine(model: Any) -> TypeGuard[nn.Module]:
    """Whether `model` loads weights the way vLLM and SGLang models do (a callable load_weights)."""
    return isinstance(model, nn.Module) and callable(getattr(model, "load_weights", None))


def _engine_rank(engine_group: Any) -> tuple[Any, int, int]:
    """(the engine ranks' group, this rank in it, their count): the default group when
    none is given, a lone rank without torch.distributed."""
    if engine_group is None and not groups.usable():
        return None, 0, 1
    return groups.resolve(engine_group), groups.rank(engine_group), groups.size(engine_group)


def _refit_rank(group: Any) -> int | None:
    """This process's rank in the refit group, where this process can tell."""
    if not groups.usable(group):
        return None
    r = groups.rank(group)
    return r if r >= 0 else None


def trace(model: nn.Module, *, weights: Any = None, group: Any = None, rank_offset: int | None = None,
          engine_group: Any = None, load: Loader | None = None, timeout: float | None = None) -> EngineEntries:
    """Traces `model`'s loader and returns this engine rank's plan entries. Collective over
    `engine_group`: every engine rank calls it; an error on one raises on all of them.

    weights: the Hugging Face tensors the loader takes (reshard_ext.engines.checkpoint.specs_of:
      a safetensors checkpoint path, {name: tensor or (shape, dtype)}, or None for the
      checkpoint named by ``model.config._name_or_path``), in checkpoint order.
    group, rank_offset: engine rank i is rank ``rank_offset + i`` of the refit group `group`
      (the group passed to rx.plan). rank_offset None: found from this rank's place in
      `group` (every engine rank must find the same); given, it is checked against it.
    engine_group: a torch.distributed group of exactly the engine's ranks, in engine rank
      order (default: the default group, i.e. the engine's own world when the engine is
      its own job or shares the trainer's processes; pass the subgroup when only some
      ranks of one job hold the engine).
    load: the loader to trace (default ``model.load_weights``).
    timeout: seconds to wait for the other engine ranks (default RESHARD_EXT_TIMEOUT).
    """
    engine_group, index, size = _engine_rank(engine_group)
    summary: dict | None = None
    error = ""
    specs: dict = {}
    local = None
    mine = _refit_rank(group)
    offset = rank_offset if rank_offset is not None else (mine - index if mine is not None else 0)
    try:
        specs = specs_of(weights, model)
        if mine is not None and mine != offset + index:
            raise ReshardError(f"engine rank {index} is rank {mine} of the refit group, not rank_offset + {index} = "
                               f"{offset + index}: pass the refit rank of engine rank 0 as rank_offset, or an "
                               f"engine_group whose ranks are the engine's in order")
        local = trace_loader(model, specs, load)
        summary = local.summary()
    except Exception as e:  # noqa: BLE001 - reported to every engine rank below
        error = f"engine rank {index}: {e if isinstance(e, ReshardError) else f'{type(e).__name__}: {e}'}"
    key = hashlib.blake2b(repr([(n, s, str(d)) for n, (s, d) in specs.items()]).encode(), digest_size=8).hexdigest()
    payload = (summary, error, key, offset)
    gathered = [payload] if size == 1 else all_gather_objects(
        payload, engine_group, "rx.adapters.engine.trace (the engine ranks exchanging their traces over "
        "engine_group, by default the default group: where some of its ranks hold no engine, pass the engine "
        "ranks' subgroup as engine_group=)", timeout)
    errors = [g[1] for g in gathered if g[1]]
    if not errors and len({g[2] for g in gathered}) > 1:
        errors = ["the engine ranks traced different lists of Hugging Face tensors (weights=...)"]
    if not errors and len({g[3] for g in gathered}) > 1:
        errors = [f"the engine ranks found different rank offsets {[g[3] for g in gathered]} in the refit group: "
                  f"pass rank_offset, or an engine_group whose ranks are the engine's in order"]
    if errors:
        raise ReshardError("tracing the engine's load_weights failed:\n  " + "\n  ".join(errors))
    assert local is not None
    decisions = decide([g[0] or {} for g in gathered], specs, offset)
    shape = attention_shape(getattr(model, "config", None))
    reshape = None if shape is None else functools.partial(_grouped, shape=shape)
    return EngineEntries(model, local, decisions, offset + index, load, reshape=reshape)


def _grouped(entries: dict, rank: int, shape: dict[str, int]) -> dict:
    """Grouped-query q/k/v in the shapes every side describes them in (adapters.hf_names)."""
    return grouped_qkv(entries, rank, **shape)


def entries(model: nn.Module, group: Any = None, rank_offset: int | None = None, *, weights: Any = None,
            engine_group: Any = None, load: Loader | None = None) -> EngineEntries:
    """`trace`, remembered per model: a later call returns the same entries while the
    engine's parameters are where they were, and rebinds them (no new trace) after the
    engine reallocated them with the same shapes. Collective over the engine's ranks when
    it traces (the first call)."""
    key = (rank_offset, id(engine_group), id(weights), id(load), id(group))
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == key:
        found: EngineEntries = hit[1]
        if not found.stale():
            return found
        found = found.rebound()
        _CACHE[model] = (key, found)
        return found
    found = trace(model, weights=weights, group=group, rank_offset=rank_offset, engine_group=engine_group, load=load)
    _CACHE[model] = (key, found)
    return found


__all__ = ["entries", "trace", "is_engine", "EngineEntries"]
