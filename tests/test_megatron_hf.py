"""Real Megatron-Core GPTModels (tiny Llama, Qwen3-MoE, DeepSeek-V3; TP2 x PP2, EP2 for
the MoE ones, on 4 gloo ranks) refit into the matching `transformers` model on rank 0
through `rx.swap_model_weights`, the Megatron side described under Hugging Face
checkpoint names. Every checkpoint tensor of the `transformers` model then equals an
independent conversion of the Megatron weights (gathered here with torch.distributed and
re-arranged with torch ops, without reshard_ext) bit for bit, and its logits on fixed ids
match the Megatron model's (a hand-run pipeline; fp32 on CPU). The transformers model
then refits a zeroed Megatron model back, bit for bit. Skipped where megatron-core or
transformers is missing."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed")
pytest.importorskip("transformers", reason="transformers not installed")

from _dist import run_ranks  # noqa: E402

TP, PP = 2, 2
# What each family's test passes as hf_names on every rank (ranks 1-3 hold no HF model, so
# they cannot infer the family from it): inferred, a family name, a HF config.
HF_NAMES = {"llama": lambda mh: True, "qwen3_moe": lambda mh: "qwen3_moe",
            "deepseek_v3": lambda mh: mh.hf_config("deepseek_v3")}
def _refit(rank: int, world: int, family: str) -> dict:
    import _megatron_hf as mh

    import reshard_ext as rx
    from reshard_ext.planning import STATS

    src = mh.build_megatron(family, tp=TP, pp=PP, ep=2 if family != "llama" else 1, seed=1)
    mg = mh.gathered(src)
    megatron_logits = mh.megatron_logits(src)
    dst = mh.build_hf(family) if rank == 0 else None
    rx.swap_model_weights(src, dst, hf_names=HF_NAMES[family](mh))
    before = dict(STATS)
    rx.swap_model_weights(src, dst, hf_names=HF_NAMES[family](mh))  # warm: the cached plan, both descriptions kept
    out: dict = {"megatron_logits": megatron_logits,
                 "warm": {k: STATS[k] - before[k] for k in ("plans", "describe_reused")}}
    # And back: the transformers model refits a zeroed Megatron model (HF names on the
    # destination side: q/k/v, gate/up and expert views written in place).
    back = mh.build_megatron(family, tp=TP, pp=PP, ep=2 if family != "llama" else 1, seed=2)
    with torch.no_grad():
        for t in back.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.zero_()
    rx.swap_model_weights(dst, back, hf_names=HF_NAMES[family](mh))
    theirs = back.state_dict()
    out["back_differ"] = sorted(n for n, t in src.state_dict().items()
                                if isinstance(t, torch.Tensor) and not torch.equal(t, theirs[n]))
    if dst is not None:
        assert mg is not None
        want = mh.reference(mg, family)
        got = mh.hf_checkpoint(dst)
        out["missing"] = sorted(set(want) - set(got))
        out["extra"] = sorted(set(got) - set(want))
        out["differ"] = sorted(k for k in want if k in got and not torch.equal(want[k], got[k]))
        out["hf_logits"] = mh.hf_logits(dst)
    rx.clear_caches()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_megatron_tp2_pp2_into_transformers(family: str) -> None:
    results = run_ranks(4, _refit, family, timeout=600)
    first = results[0]
    assert [r["back_differ"] for r in results] == [[]] * 4, [r["back_differ"][:3] for r in results]
    warm = [{"plans": 0, "describe_reused": 2 if r == 0 else 1} for r in range(4)]  # rank 0 holds both models
    assert [r["warm"] for r in results] == warm
    assert first["missing"] == [] and first["extra"] == [], (first["missing"][:5], first["extra"][:5])
    assert first["differ"] == [], first["differ"][:5]
    megatron_logits = results[TP * (PP - 1)]["megatron_logits"]  # the last stage's first rank
    assert megatron_logits is not None
    diff = float((first["hf_logits"] - megatron_logits).abs().max())
    assert torch.allclose(first["hf_logits"], megatron_logits, rtol=1e-4, atol=1e-4), diff
