"""Inference engines as refit destinations (vLLM, SGLang, or any model whose
``load_weights(iterable of (hf_name, tensor))`` loads a Hugging Face checkpoint).

`entries(model, group=..., rank_offset=..., weights=...)` traces the engine's own loader
once on every engine rank (reshard_ext.engines), the engine ranks agree on one layout per
Hugging Face tensor, and the result (`EngineEntries`) is this rank's plan entries: views
into the engine's fused, padded, TP/EP-sharded parameters, so that a refit writes each
rank's slice straight where the loader would put it. Collective over the engine's ranks
(`engine_group`); the trainer side describes its model under Hugging Face names.

    dst = rx.adapters.engine.entries(llm_model, group=refit_group, rank_offset=trainer_world)
    plan = rx.plan(src=None, dst=dst, group=refit_group)   # once
    rx.execute(plan); dst.finish()                          # every refit
    # then the engine's post-load step, if any (see reshard_ext.engines)
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, TypeGuard

import torch.distributed as dist
from torch import nn

from ..collectives import all_gather_objects
from ..engines.checkpoint import specs_of
from ..engines.entries import EngineEntries, decide
from ..engines.trace import Loader, trace_loader
from ..errors import ReshardError

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_engine(model: Any) -> TypeGuard[nn.Module]:
    """Whether `model` loads weights the way vLLM and SGLang models do (a callable load_weights)."""
    return isinstance(model, nn.Module) and callable(getattr(model, "load_weights", None))


def _engine_rank(engine_group: Any) -> tuple[Any, int, int]:
    if engine_group is None and dist.is_initialized():
        engine_group = dist.group.WORLD
    if engine_group is None:
        return None, 0, 1
    return engine_group, dist.get_rank(engine_group), dist.get_world_size(engine_group)


def trace(model: nn.Module, *, weights: Any = None, group: Any = None, rank_offset: int = 0,
          engine_group: Any = None, load: Loader | None = None, timeout: float | None = None) -> EngineEntries:
    """Traces `model`'s loader and returns this engine rank's plan entries. Collective over
    `engine_group`: every engine rank calls it; an error on one raises on all of them.

    weights: the Hugging Face tensors the loader takes (reshard_ext.engines.checkpoint.specs_of:
      a safetensors checkpoint path, {name: tensor or (shape, dtype)}, or None for the
      checkpoint named by ``model.config._name_or_path``), in checkpoint order.
    group, rank_offset: engine rank i is rank ``rank_offset + i`` of the refit group `group`
      (the group passed to rx.plan; checked where this process can tell).
    engine_group: a torch.distributed group of exactly the engine's ranks, in engine rank
      order (default: the default group, i.e. the engine's own world when the engine is
      its own job or shares the trainer's processes; pass the subgroup when only some
      ranks of one job hold the engine).
    load: the loader to trace (default ``model.load_weights``).
    timeout: seconds to wait for the other engine ranks (default RESHARD_EXT_P2P_TIMEOUT).
    """
    engine_group, index, size = _engine_rank(engine_group)
    summary: dict | None = None
    error = ""
    specs: dict = {}
    local = None
    try:
        specs = specs_of(weights, model)
        if group is not None or dist.is_initialized():
            mine = dist.get_rank(group)
            if mine >= 0 and mine != rank_offset + index:
                raise ReshardError(f"engine rank {index} is rank {mine} of the refit group, not rank_offset + {index} "
                                   f"= {rank_offset + index}: pass the rank of engine rank 0 in the refit group as "
                                   f"rank_offset")
        local = trace_loader(model, specs, load)
        summary = local.summary()
    except Exception as e:  # noqa: BLE001 - reported to every engine rank below
        error = f"engine rank {index}: {e if isinstance(e, ReshardError) else f'{type(e).__name__}: {e}'}"
    key = hashlib.blake2b(repr([(n, s, str(d)) for n, (s, d) in specs.items()]).encode(), digest_size=8).hexdigest()
    payload = (summary, error, key)
    gathered = [payload] if size == 1 else all_gather_objects(
        payload, engine_group, "rx.adapters.engine.trace (engine ranks exchanging their traces)", timeout)
    errors = [e for _, e, _ in gathered if e]
    if not errors and len({k for *_, k in gathered}) > 1:
        errors = ["the engine ranks traced different lists of Hugging Face tensors (weights=...)"]
    if errors:
        raise ReshardError("tracing the engine's load_weights failed:\n  " + "\n  ".join(errors))
    assert local is not None
    decisions = decide([s or {} for s, _, _ in gathered], specs, rank_offset)
    return EngineEntries(model, local, decisions, rank_offset + index, load)


def entries(model: nn.Module, group: Any = None, rank_offset: int = 0, *, weights: Any = None,
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
