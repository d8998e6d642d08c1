"""A warm swap_model_weights agrees in its execute's headers (the swap round).

Every rank of a small group sends its plan generation and a REPLAN flag to every other
rank in the headers of the cached plan's execute; a rank whose lookup missed (a changed
model, a failed description, tensors to rebind, no plan) sends REPLAN from outside any
execute. Checked here: warm swaps do no all-reduce and stay bit exact; a change on one rank
(a data peer or not) sends every rank through the slow path together, with no data moved
by the round; a failed description raises on every rank; large groups all-reduce instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import GPT, Config, expected_local, fill, make_groups, tensors_with_origin

import reshard_ext as rx

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs2 = pytest.mark.skipif(GPUS < 2 or not rx.build_info()["cuda"],
                            reason="needs 2 GPUs and reshard_ext built with CUDA")
MOE = Config(num_moe_experts=4)

# src spec, dst spec: rank 0 -> rank 1 ("peers", a third rank idle: no data with anyone), or
# a replica of both models on every rank ("local": same-rank copies only, no data peers)
LAYOUTS = {"peers": (dict(base=0), dict(base=1)), "local": (dict(dp=2), dict(dp=2))}


def _build(world: int, spec: dict, cfg: Config, device: str) -> GPT | None:
    groups = make_groups(world, **{"tp": 1, "pp": 1, "dp": 1, "base": 0, **spec})
    return None if groups is None else GPT(cfg, groups).to(device)


def _bad(model: GPT | None, seed: int) -> list[str]:
    """Tensors of `model` that differ (bit for bit) from the seed's logical weights."""
    if model is None:
        return []
    return [n for n, t in tensors_with_origin(model)
            if not torch.equal(t.cpu(), expected_local(t._origin, seed, t.dtype))]


def _change(rank: int, how: str, dst: GPT | None) -> GPT | None:
    from reshard_ext import swap

    if how == "clear":  # a lookup miss without any model change (closing communicators would be collective)
        swap.clear_caches(communicators=False)
    elif how == "restride":  # same layouts, new storage: a rebind
        assert dst is not None
        w = next(t for _, t in tensors_with_origin(dst) if t.dim() == 2 and min(t.shape) > 1)
        w.data = torch.zeros(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device).t()
    elif how == "fail":  # this rank cannot describe its destination
        assert dst is not None
        dst.pg_collection = None
    return dst


def _scenario(rank: int, world: int, layout: str, device: str, backend: str, how: str, changer: int,
              header_ranks: int | None = None) -> Any:
    from reshard_ext import planning, swap
    from reshard_ext.errors import ReshardError

    swap.clear_caches()
    opts = rx.Options(timeout=30)  # a rank left waiting raises within this, not the group's timeout
    src_spec, dst_spec = LAYOUTS[layout]
    src, dst = _build(world, src_spec, MOE, device), _build(world, dst_spec, MOE, device)
    agreements = [0]
    real = swap._agree

    def counting(*a: Any, **k: Any) -> Any:
        agreements[0] += 1
        return real(*a, **k)

    def refit(seed: int) -> tuple[int, int]:
        """(plans made, agreements by all-reduce) of a swap after filling the source with `seed`."""
        if src is not None:
            fill(src, seed)
        plans, agreements[0] = planning.STATS["plans"], 0
        swap.swap_model_weights(src, dst, backend=backend, options=opts)
        return planning.STATS["plans"] - plans, agreements[0]

    swap._agree = counting
    if header_ranks is not None:
        swap.HEADER_AGREEMENT_RANKS = header_ranks
    try:
        out: dict[str, Any] = {"cold": refit(1), "bad_cold": _bad(dst, 1)}
        out["warm"] = [refit(seed) for seed in (2, 3, 4)]
        out["bad_warm"] = _bad(dst, 4)
        if rank == changer:
            dst = _change(rank, how, dst)
        try:
            out["changed"] = refit(5)
        except ReshardError as e:
            out["changed"] = f"raised: {e}"
            out["untouched"] = _bad(dst, 4)  # the round moved no data: still the last refit's weights
            return out
        out["bad_changed"] = _bad(dst, 5)
        out["after"] = refit(6)  # warm again: the new plan (or binding) is the cached one everywhere
        out["bad_after"] = _bad(dst, 6)
        return out
    finally:
        swap._agree, swap.HEADER_AGREEMENT_RANKS = real, 8


def _run(world: int, layout: str, how: str, changer: int, device: str = "cpu", backend: str = "auto",
         header_ranks: int | None = None) -> list[dict]:
    results = run_ranks(world, _scenario, layout, device, backend, how, changer, header_ranks,
                        backend="nccl" if device == "cuda" else "gloo")
    for r in results:
        assert r["bad_cold"] == [] and r["bad_warm"] == [], r
    return results


def _check_slow_path(results: list[dict], how: str, header_ranks: int | None = None) -> None:
    warm_agreements = 0 if header_ranks is None else 1
    for rank, r in enumerate(results):
        assert r["warm"] == [(0, warm_agreements)] * 3, f"rank {rank}: warm swaps planned or all-reduced: {r['warm']}"
        plans, agreements = r["changed"]
        # every rank, whatever it holds, took the slow path: one agreement; a re-plan where any rank missed
        assert (plans, agreements) == (1 if how == "clear" else 0, 1), f"rank {rank}: {r['changed']}"
        assert r["bad_changed"] == [] and r["bad_after"] == [], f"rank {rank}: {r}"
        assert r["after"] == (0, warm_agreements), f"rank {rank}: the refit after the change was not warm: {r}"


@pytest.mark.parametrize("how", ["clear", "restride"])
@pytest.mark.parametrize("layout", ["peers", "local"])
def test_one_rank_missing_its_cache_sends_every_rank_through_the_slow_path(layout: str, how: str) -> None:
    _check_slow_path(_run(2, layout, how, changer=1), how)


@pytest.mark.parametrize("changer", [1, 2])
def test_a_rank_without_data_peers_hears_and_is_heard(changer: int) -> None:
    # rank 2 holds no model: it moves no data with anyone, yet it re-plans with the others
    # when rank 1 misses its cache (changer 1), and they with it (changer 2)
    _check_slow_path(_run(3, "peers", "clear", changer), "clear")


def test_a_restrided_destination_beside_an_idle_rank_is_rebound() -> None:
    _check_slow_path(_run(3, "peers", "restride", changer=1), "restride")


@pytest.mark.parametrize("layout", ["peers", "local"])
def test_a_failed_description_on_one_rank_raises_on_every_rank_and_moves_nothing(layout: str) -> None:
    world = 3 if layout == "peers" else 2
    for rank, r in enumerate(_run(world, layout, "fail", changer=1)):
        assert isinstance(r["changed"], str) and r["changed"].startswith("raised"), f"rank {rank}: {r}"
        if rank != 1:
            assert "rank 1 failed to describe" in r["changed"], r["changed"]
        assert r["untouched"] == [], f"rank {rank}: data moved although rank 1 could not describe its model"


def test_large_groups_agree_by_all_reduce() -> None:
    _check_slow_path(_run(2, "peers", "clear", changer=1, header_ranks=1), "clear", header_ranks=1)


def test_a_model_change_on_one_rank_replans_bit_exact() -> None:
    results = run_ranks(3, _dtype_change)
    for rank, (replans, bad) in enumerate(results):
        assert replans == 1 and bad == [], f"rank {rank}: {replans} plans, wrong tensors {bad}"


def _dtype_change(rank: int, world: int) -> Any:
    from reshard_ext import planning
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    src = _build(world, dict(base=0), MOE, "cpu")
    dst = _build(world, dict(base=1), MOE, "cpu")
    for seed in (1, 2):
        if src is not None:
            fill(src, seed)
        swap_model_weights(src, dst)
    plans = planning.STATS["plans"]
    # Only rank 1 changes (its router buffer's dtype); rank 2, idle, must re-plan with it.
    new = _build(world, dict(base=1), dataclasses.replace(MOE, bias_dtype=torch.bfloat16), "cpu")
    if src is not None:
        fill(src, 3)
    swap_model_weights(src, new)
    return planning.STATS["plans"] - plans, _bad(new, 3)


# --- GPU: the NCCL and direct transports carry the same round ------------------------------


@needs2
@pytest.mark.parametrize("backend", ["nccl", "direct"])
@pytest.mark.parametrize("how", ["clear", "restride"])
@pytest.mark.parametrize("layout", ["peers", "local"])
def test_gpu_slow_path_together(layout: str, how: str, backend: str) -> None:
    _check_slow_path(_run(2, layout, how, changer=1, device="cuda", backend=backend), how)


@needs2
@pytest.mark.parametrize("backend", ["nccl", "direct"])
def test_gpu_failed_description_raises_everywhere(backend: str) -> None:
    for rank, r in enumerate(_run(2, "peers", "fail", changer=1, device="cuda", backend=backend)):
        assert isinstance(r["changed"], str) and r["changed"].startswith("raised"), f"rank {rank}: {r}"
        assert r["untouched"] == [], f"rank {rank}: data moved"


def _relayed(rank: int, world: int) -> Any:
    from reshard_ext import planning, relay, swap

    swap.clear_caches()
    src = _build(world, dict(base=0), MOE, "cpu")  # one source, four replicas: a relayed plan
    dst = _build(world, dict(dp=world), MOE, "cpu")
    kinds = []
    cold = planning.STATS["plans"]
    for seed in (1, 2, 3):
        if src is not None:
            fill(src, seed)
        swap.swap_model_weights(src, dst)
        kinds.append(type(swap._PLANS[next(iter(swap._PLANS))].plan) is relay.RelayPlan)
    plans = planning.STATS["plans"]
    cold = plans - cold  # a relayed plan counts its stages
    if rank == 3:
        swap.clear_caches()
    if src is not None:
        fill(src, 4)
    swap.swap_model_weights(src, dst)
    return kinds, cold, planning.STATS["plans"] - plans, _bad(dst, 4)


def test_a_relayed_plan_carries_the_round_in_its_first_stage() -> None:
    for rank, (relayed, cold, replans, bad) in enumerate(run_ranks(4, _relayed)):
        assert relayed == [True] * 3, f"rank {rank}: not a relayed plan, the test misses its point"
        # rank 3 missed its cache: every rank planned again, once, as cold; warm swaps planned nothing
        assert replans == cold > 0 and bad == [], f"rank {rank}: {replans} plans (cold {cold}), wrong tensors {bad}"
