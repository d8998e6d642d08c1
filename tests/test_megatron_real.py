"""Refits between real Megatron-Core GPTModels (skipped where megatron-core is not
installed): the destination computes the source's logits, a refit back restores every
source tensor bit for bit, and on GPUs the result equals Megatron-Core's own
swap_model_weights(refit_method="nccl") byte for byte."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed")

from _dist import run_ranks  # noqa: E402

CASES = {  # name -> (src kwargs, dst kwargs)
    "tp2-tp1": (dict(tp=2), dict(tp=1)),
    "tp1-tp2": (dict(tp=1), dict(tp=2)),
    "ep2-ep1": (dict(ep=2, experts=4), dict(ep=1, experts=4)),
    "tp2ep1-tp1ep2": (dict(tp=2, ep=1, experts=4), dict(tp=1, ep=2, experts=4)),
}


def _refit(rank: int, world: int, case: str, compare_mcore: bool) -> dict:
    import _megatron_real as mr

    import reshard_ext as rx

    src_kw, dst_kw = CASES[case]
    # Megatron's MoE router only runs on CUDA: on CPU, MoE cases check bits only.
    forward = torch.cuda.is_available() or not src_kw.get("experts")
    src = mr.build(seed=1, **src_kw)
    want = mr.logits(src) if forward else torch.zeros(())
    before = mr.tensors(src)
    dst = mr.build(seed=2, **dst_kw)
    rx.swap_model_weights(src, dst)
    got = mr.logits(dst) if forward else torch.zeros(())
    back = mr.build(seed=3, **src_kw)
    rx.swap_model_weights(dst, back)
    after = mr.tensors(back)
    out = {
        "logits_close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)),
        "logits_max_diff": float((got - want).abs().max()),
        "round_trip_differs": sorted(n for n in before if not torch.equal(before[n], after[n])),
    }
    if compare_mcore:
        from megatron.core.resharding.refit import swap_model_weights as mcore_swap

        ref = mr.build(seed=4, **dst_kw)
        mcore_swap(src, ref, "nccl")
        theirs, ours = mr.tensors(ref), mr.tensors(dst)
        out["differs_from_mcore"] = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
    rx.clear_caches()
    return out


def _check(results: list[dict]) -> None:
    for r, res in enumerate(results):
        assert res["logits_close"], (r, res["logits_max_diff"])
        assert res["round_trip_differs"] == [], (r, res["round_trip_differs"][:5])
        assert res.get("differs_from_mcore", []) == [], (r, res["differs_from_mcore"][:5])


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_gpt_cpu(case):
    _check(run_ranks(2, _refit, case, False, timeout=600))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", sorted(CASES))
def test_real_gpt_gpu_vs_megatron(case):
    _check(run_ranks(2, _refit, case, True, backend="nccl", timeout=600))
