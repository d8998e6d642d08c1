"""Refits between real Megatron-Core GPTModels (skipped where megatron-core is not
installed): TP, EP, TP+EP, a tied head and PP stages. The destination computes the
source's logits (PP: each stage holds its global layers), a refit back restores every
source tensor bit for bit, and on GPUs the result equals Megatron-Core's own
swap_model_weights(refit_method="nccl") byte for byte wherever Megatron-Core's result is
itself right (its logits match the source's); for MoE layouts it gets wrong or refuses,
its outcome is printed instead (seen with 0.19.2: EP2->EP1 raises, TP2->TP1+EP2 gives
other expert weights)."""
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
    "tied-tp2-tp1": (dict(tp=2, tied=True), dict(tp=1)),  # the head comes from the word embeddings
}
CASES_4 = {  # on 4 ranks (CPU only)
    "tp2-tp4": (dict(tp=2, query_groups=4), dict(tp=4, query_groups=4)),
    "ep2-ep4": (dict(ep=2, experts=4), dict(ep=4, experts=4)),
    "ep4-ep1": (dict(ep=4, experts=4), dict(ep=1, experts=4)),
}


def _refit(rank: int, world: int, case: str, on_gpu: bool) -> dict:
    import _megatron_real as mr

    import reshard_ext as rx

    src_kw, dst_kw = {**CASES, **CASES_4}[case]
    # Megatron's MoE router only runs on CUDA: on CPU, MoE cases check bits only.
    forward = on_gpu or not src_kw.get("experts")
    src = mr.build(seed=1, cuda=on_gpu, **src_kw)
    want = mr.logits(src) if forward else torch.zeros(())
    before = mr.tensors(src)
    dst = mr.build(seed=2, cuda=on_gpu, **dst_kw)
    rx.swap_model_weights(src, dst)
    got = mr.logits(dst) if forward else torch.zeros(())
    back = mr.build(seed=3, cuda=on_gpu, **src_kw)
    rx.swap_model_weights(dst, back)
    after = mr.tensors(back)
    out = {
        "logits_close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4)),
        "logits_max_diff": float((got - want).abs().max()),
        "round_trip_differs": sorted(n for n in before if not torch.equal(before[n], after[n])),
    }
    if on_gpu:  # Megatron-Core's own NCCL refit of the same models
        from megatron.core.resharding.refit import swap_model_weights as mcore_swap

        ref = mr.build(seed=4, cuda=True, **dst_kw)
        try:
            mcore_swap(src, ref, "nccl")
            torch.cuda.synchronize()  # its copies may still be in flight on other streams
        except Exception as e:  # noqa: BLE001 - recorded: Megatron-Core fails some layouts
            out["mcore"] = f"raised {type(e).__name__}: {e}"
        else:
            mcore_logits = mr.logits(ref)
            out["mcore_correct"] = bool(torch.allclose(mcore_logits, want, rtol=1e-4, atol=1e-4))
            theirs, ours = mr.tensors(ref), mr.tensors(dst)
            out["differs_from_mcore"] = sorted(n for n in ours if not torch.equal(ours[n], theirs[n]))
            out["mcore"] = "correct" if out["mcore_correct"] else \
                (f"wrong logits (max diff {float((mcore_logits - want).abs().max()):.3g}); "
                 f"{len(out['differs_from_mcore'])} tensors differ from ours, e.g. {out['differs_from_mcore'][:3]}")
    rx.clear_caches()
    return out


def _check(results: list[dict]) -> None:
    for r, res in enumerate(results):
        assert res["logits_close"], (r, res["logits_max_diff"])
        assert res["round_trip_differs"] == [], (r, res["round_trip_differs"][:5])
        if res.get("mcore_correct"):  # where Megatron-Core itself is right, we match it bit for bit
            assert res["differs_from_mcore"] == [], (r, res["differs_from_mcore"][:5])
        if "mcore" in res:
            print(f"rank {r}: Megatron-Core's swap_model_weights: {res['mcore']}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_real_gpt_cpu(case):
    _check(run_ranks(2, _refit, case, False, timeout=600))  # gloo, CPU models, even on a GPU machine


@pytest.mark.parametrize("case", sorted(CASES_4))
def test_real_gpt_cpu_4_ranks(case):
    _check(run_ranks(4, _refit, case, False, timeout=600))


def _pp_round_trip(rank: int, world: int) -> dict:
    """PP1 -> PP2 -> PP1: each stage holds its global layers (layer_number offsets), the
    embedding on the first stage, the head and final norm on the last; the trip back
    restores every tensor. (A PP forward needs Megatron's pipeline schedule: bits only.)"""
    import re

    import _megatron_real as mr

    import reshard_ext as rx

    a = mr.build(pp=1, layers=4, seed=1, cuda=False)
    whole = mr.tensors(a)
    staged = mr.build(pp=2, layers=4, seed=2, cuda=False)
    rx.swap_model_weights(a, staged)
    stage = staged.pg_collection.pp.rank()

    def global_name(n: str) -> str:
        return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + 2 * stage}.", n)

    mine = mr.tensors(staged)
    wrong = sorted(n for n in mine if not torch.equal(mine[n], whole[global_name(n)]))
    back = mr.build(pp=1, layers=4, seed=3, cuda=False)
    rx.swap_model_weights(staged, back)
    after = mr.tensors(back)
    rx.clear_caches()
    return {"stage": stage, "names": sorted(mine), "wrong": wrong,
            "round_trip_differs": sorted(n for n in whole if not torch.equal(whole[n], after[n]))}


def test_real_gpt_pp_cpu():
    results = run_ranks(2, _pp_round_trip, timeout=600)
    for r, res in enumerate(results):
        assert res["wrong"] == [] and res["round_trip_differs"] == [], (r, res)
    first, last = results[0]["names"], results[1]["names"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", sorted(CASES))
def test_real_gpt_gpu_vs_megatron(case):
    """Ours must reproduce the source's logits; where Megatron-Core's own refit does too,
    ours must equal its destination bit for bit. Megatron-Core itself is not asserted:
    0.19.2 on 2x H200 (2026-11-26) got this 4-layer GPT's untied TP2->TP1
    output_layer.weight wrong (logits off by 1.43, with or without NCCL registration in
    reshard_ext), while its tied and TP1->TP2 refits matched ours bit for bit."""
    results = run_ranks(2, _refit, case, True, backend="nccl", timeout=600)
    _check(results)
    if not CASES[case][0].get("experts"):  # dense: Megatron-Core ran (no exception) and was compared
        assert all("mcore_correct" in r for r in results), [r.get("mcore") for r in results]
