"""swap_model_weights between differently-parallel tiny Megatron-like models (gloo, CPU).

Each case refits a zero-initialised destination from a source filled with seed 1, then
checks every destination tensor bit for bit against the logical weights and that both
models compute the same logits.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import GPT, Config, check_filled, fill, make_groups

IDS = torch.tensor([0, 3, 7, 12, 15, 9])


def _build(world: int, spec: dict | None, cfg: Config, seed: int | None) -> GPT | None:
    if spec is None:
        return None
    pg = make_groups(world, **spec)
    if pg is None:
        return None
    model = GPT(cfg, pg)
    if seed is not None:
        fill(model, seed)
    return model


def _refit(rank: int, world: int, src_spec, dst_spec, cfg: Config, dst_cfg: Config | None, kwargs: dict) -> Any:
    import reshard_ext as rx
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, src_spec, cfg, seed=1)
    dst = _build(world, dst_spec, dst_cfg or cfg, seed=None)
    if cfg.tied and dst is not None and getattr(getattr(dst, "output_layer", None), "weight", None) is not None:
        w = dst.output_layer.weight  # a tied source's output weight is its word embeddings
        w._origin = ("embedding.word_embeddings.weight",) + w._origin[1:]
    swap_model_weights(src, dst, **kwargs)
    bad = check_filled(dst, 1) if dst is not None else []
    src_logits = src(IDS) if src is not None else None
    dst_logits = dst(IDS) if dst is not None else None
    return bad, src_logits, dst_logits, rx is not None


def _check(results: list) -> None:
    logits = []
    for rank, (bad, s, d, _) in enumerate(results):
        assert bad == [], f"rank {rank}: tensors differ from the source's logical weights: {bad}"
        logits += [x for x in (s, d) if x is not None]
    assert len(logits) >= 2
    for x in logits[1:]:
        torch.testing.assert_close(x, logits[0], rtol=1e-5, atol=1e-5)


def S(tp=1, pp=1, dp=1, ep=1, etp=None, base=0) -> dict:
    return dict(base=base, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)


DENSE = Config()
MOE = Config(num_moe_experts=4)
CASES = {
    "tp2->tp1": (2, S(tp=2), S(dp=2), DENSE, None),
    "tp1->tp2": (2, S(dp=2), S(tp=2), DENSE, None),
    "tp2->tp4": (4, S(tp=2, dp=2), S(tp=4), DENSE, None),
    "pp2->pp1": (2, S(pp=2), S(tp=2), DENSE, None),
    "pp1->pp2": (2, S(tp=2), S(pp=2), DENSE, None),
    "tp2pp2->tp4": (4, S(tp=2, pp=2), S(tp=4), Config(layers=4), None),
    "ep2->ep4": (4, S(dp=4, ep=2), S(dp=4, ep=4), MOE, None),
    "ep4->ep1": (4, S(dp=4, ep=4), S(dp=4), MOE, None),
    "tp2ep2->tp4": (4, S(tp=2, dp=2, ep=2, etp=1), S(tp=4), MOE, None),
    "tp1ep4->tp2ep2etp1": (4, S(dp=4, ep=4), S(tp=2, dp=2, ep=2, etp=1), MOE, None),
    "non_collocated_tp2->tp1dp2": (4, S(tp=2), S(dp=2, base=2), DENSE, None),
    "idle_rank": (4, S(tp=2), S(base=2), DENSE, None),
    "buffer_fp32->bf16": (2, S(dp=2, ep=2), S(tp=2, ep=1), MOE, dataclasses.replace(MOE, bias_dtype=torch.bfloat16)),
    "tied_pp1->tied_pp2": (2, S(tp=2), S(pp=2), Config(tied=True), None),
    "tied->untied": (2, S(tp=2), S(dp=2), Config(tied=True), Config(tied=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refit(case: str) -> None:
    world, src, dst, cfg, dst_cfg = CASES[case]
    _check(run_ranks(world, _refit, src, dst, cfg, dst_cfg, {}))


# --- rank offsets: a destination model living in another world ------------------------


def _offset_refit(rank: int, world: int, offset: int) -> Any:
    import reshard_ext.adapters.megatron as meg
    from reshard_ext.errors import ReshardError

    real = meg._pg_ranks
    if rank >= 2:  # the destination's own world numbers its ranks 0, 1
        meg._pg_ranks = lambda pg: [r - 2 for r in real(pg)]
    try:
        return _refit(rank, world, S(tp=2), S(tp=2, base=2), DENSE, None, {"dst_rank_offset": offset})
    except ReshardError as e:
        return str(e)
    finally:
        meg._pg_ranks = real


def test_rank_offset_places_a_model_from_another_world() -> None:
    _check(run_ranks(4, _offset_refit, 2))


def test_missing_rank_offset_raises_on_every_rank() -> None:
    results = run_ranks(4, _offset_refit, 0)
    assert all(isinstance(r, str) for r in results), results


# --- caches ------------------------------------------------------------------------


def _warm(rank: int, world: int) -> Any:
    import torch.distributed as dist

    import reshard_ext
    from reshard_ext import planning
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(tp=2), DENSE, seed=1)
    dst = _build(world, S(dp=2), DENSE, seed=None)
    swap_model_weights(src, dst)
    calls = {"plan": 0, "all_gather": 0, "all_reduce": 0}
    real = (reshard_ext.plan, dist.all_gather_object, dist.all_gather, dist.all_reduce)

    def counting(key, fn):
        def wrapper(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapper

    stats = dict(planning.STATS)
    fill(src, 2)  # training updates the source in place
    reshard_ext.plan = counting("plan", real[0])
    import reshard_ext.swap as swap_mod
    swap_mod.dist.all_reduce = counting("all_reduce", real[3])
    try:
        swap_model_weights(src, dst)
        warm_stats = dict(planning.STATS)
        warm_calls = dict(calls)
        # A re-created destination with the same layouts: the cached plan is rebound.
        dst2 = _build(world, S(dp=2), DENSE, seed=None)
        swap_model_weights(src, dst2)
    finally:
        reshard_ext.plan = real[0]
        swap_mod.dist.all_reduce = real[3]
    rebind_calls = {k: calls[k] - warm_calls[k] for k in calls}
    return stats, warm_stats, dict(planning.STATS), (warm_calls, rebind_calls), check_filled(dst, 2), \
        check_filled(dst2, 2)


def _moved(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in ("exchanges", "plans", "describe_reused")}


def test_warm_swap_does_no_exchange_and_no_planning() -> None:
    for stats, warm, after_rebind, calls, bad, bad2 in run_ranks(2, _warm):
        # warm: both descriptions reused, nothing exchanged, nothing planned
        assert _moved(stats, warm) == {"exchanges": 0, "plans": 0, "describe_reused": 2}
        moved = _moved(warm, after_rebind)  # a re-created destination is described again ...
        assert moved["exchanges"] == 0 and moved["plans"] == 0, "... but same layouts must not replan"
        warm_calls, rebind_calls = calls
        assert warm_calls == {"plan": 0, "all_gather": 0, "all_reduce": 0}  # the agreement rode in the headers
        assert rebind_calls == {"plan": 0, "all_gather": 0, "all_reduce": 1}  # the slow path's one agreement
        assert bad == [] and bad2 == []


def _storage_swapped(rank: int, world: int) -> Any:
    from reshard_ext import planning
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(tp=2), DENSE, seed=1)
    dst = _build(world, S(dp=2), DENSE, seed=None)
    swap_model_weights(src, dst)
    swap_model_weights(src, dst)  # warm
    before = dict(planning.STATS)
    # Same model objects, new storage under every destination parameter (as offloading
    # does): the reused description would point at the old storage; it must not be reused.
    for p in dst.parameters():
        p.data = torch.full_like(p.data, -1)
    fill(src, 2)
    swap_model_weights(src, dst)
    return _moved(before, planning.STATS), check_filled(dst, 2)


def test_swapped_storage_is_noticed() -> None:
    for moved, bad in run_ranks(2, _storage_swapped):
        assert moved["plans"] == 0 and moved["describe_reused"] == 1  # src reused, dst described again
        assert bad == []


def _changed_model(rank: int, world: int) -> Any:
    from reshard_ext import planning
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    swap_model_weights(_build(world, S(tp=2), DENSE, 1), _build(world, S(dp=2), DENSE, None))
    plans = planning.STATS["plans"]
    # Same parallel sizes, different model: Megatron's size-keyed cache would reuse the plan.
    wider = dataclasses.replace(DENSE, ffn=16)
    src, dst = _build(world, S(tp=2), wider, 1), _build(world, S(dp=2), wider, None)
    swap_model_weights(src, dst)
    return planning.STATS["plans"] - plans, check_filled(dst, 1)


def test_changed_model_with_same_sizes_replans() -> None:
    for replans, bad in run_ranks(2, _changed_model):
        assert replans == 1 and bad == []


def _one_rank_changes(rank: int, world: int) -> Any:
    from reshard_ext import planning
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(), MOE, 1)  # rank 0
    dst = _build(world, S(base=1), MOE, None)  # rank 1
    swap_model_weights(src, dst)
    plans = planning.STATS["plans"]
    # Only rank 1 changes (its buffer dtype): rank 0 alone would hit its cache.
    dst = _build(world, S(base=1), dataclasses.replace(MOE, bias_dtype=torch.bfloat16), None)
    swap_model_weights(src, dst)
    return planning.STATS["plans"] - plans, check_filled(dst, 1) if dst is not None else []


def test_one_rank_changing_makes_every_rank_replan() -> None:
    for replans, bad in run_ranks(2, _one_rank_changes):
        assert replans == 1 and bad == []


# --- errors: every rank raises together ------------------------------------------------


def _failing(rank: int, world: int, how: str) -> Any:
    from reshard_ext.errors import ReshardError
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(tp=2), DENSE, 1)
    dst = _build(world, S(dp=2), DENSE, None)
    if how == "adapter" and rank == 1:
        dst.pg_collection = None  # this rank cannot describe its model
    if how == "shape":  # built everywhere (group creation is collective), used on rank 1
        wide = _build(world, S(dp=2), dataclasses.replace(DENSE, ffn=16), None)
        dst = wide if rank == 1 else dst
    if how == "int_to_float":
        src.register_buffer("step", torch.zeros(2, dtype=torch.int64))
        dst.register_buffer("step", torch.zeros(2, dtype=torch.float32))
    try:
        swap_model_weights(src, dst)
    except ReshardError as e:
        return "raised", str(e), check_filled(dst, 1)
    return "ok", "", []


@pytest.mark.parametrize("how", ["adapter", "shape", "int_to_float"])
def test_error_on_one_rank_raises_on_every_rank(how: str) -> None:
    results = run_ranks(2, _failing, how)
    for kind, _msg, filled_bad in results:
        assert kind == "raised", results
        assert filled_bad, "data moved although planning failed"


# --- a warm swap notices a destination changed in place of the same objects ----------


def _changed_in_place(rank: int, world: int, how: str) -> Any:
    from reshard_ext import planning
    from reshard_ext.errors import ReshardError
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(tp=2), DENSE, seed=1)
    dst = _build(world, S(dp=2), DENSE, seed=None)
    swap_model_weights(src, dst)
    swap_model_weights(src, dst)  # warm: the description is memoized
    w = dst.decoder.layers[0].mlp.linear_fc2.weight  # (8, 8) on every rank: TP1
    if rank == 1:  # one rank only: the other would hit its cache
        with torch.no_grad():
            if how == "resized":
                w.resize_(4, 8)  # same object, same storage, smaller
            elif how == "restrided":
                w.data = torch.zeros(8, 8).t()  # same object and shape, column-major
            elif how == "dtype_view":
                w.data = w.data.view(torch.int32)  # same storage and shape, integer
    fill(src, 2)
    before = dict(planning.STATS)
    try:
        swap_model_weights(src, dst)
    except ReshardError as e:
        return "raised", str(e), check_filled(dst, 2)
    return "ok", _moved(before, planning.STATS), check_filled(dst, 2)


@pytest.mark.parametrize("how", ["resized", "dtype_view"])
def test_destination_changed_in_place_raises_on_every_rank(how: str) -> None:
    results = run_ranks(2, _changed_in_place, how)
    for kind, _, bad in results:
        assert kind == "raised", results
        assert bad, "data moved although one rank's destination no longer matches the plan"


def test_destination_restrided_in_place_is_rebound() -> None:
    results = run_ranks(2, _changed_in_place, "restrided")
    for rank, (kind, moved, bad) in enumerate(results):
        assert kind == "ok", results
        assert moved["plans"] == 0 and moved["describe_reused"] == 2 - rank  # rank 1 described its dst again
        assert bad == [], f"rank {rank}: {bad}"


# --- rx.execute's keywords: one answer on every rank ------------------------------------------


def _versioned(rank: int, world: int) -> Any:
    import reshard_ext as rx
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, S(tp=2, dp=2), DENSE, seed=1)
    dst = _build(world, S(tp=4), DENSE, seed=None)
    plan = swap_model_weights(src, dst, None, "auto", verify=True, version=3, timeout=60.0)  # rx.plan's order
    first = plan.version, isinstance(plan, rx.Plan), check_filled(dst, 1)
    warm = swap_model_weights(src, dst, verify=True, version=4)  # the cached plan: the swap round
    try:  # a rank passing another version raises on every rank, warm or not
        swap_model_weights(src, dst, version=5 if rank != 2 else 6)
        error = None
    except rx.ReshardError as e:
        error = str(e)
    return first, warm is plan, plan.version, error, swap_model_weights(src, dst, version=7).version


def test_swap_takes_verify_version_and_timeout_and_returns_its_plan() -> None:
    for rank, (first, same, version, error, last) in enumerate(run_ranks(4, _versioned)):
        assert first == (3, True, []), (rank, first)
        assert same and version is None and last == 7, (rank, same, version, last)
        assert error is not None and "5 on ranks [0, 1, 3], 6 on ranks [2]" in error, (rank, error)
