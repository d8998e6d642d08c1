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


# Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by * TP:
# 1000 tokens with 128 at TP2 -> 1024 (rank 1: 488 real rows, 24 padding); 100 tokens
# -> 256 (rank 1: only padding).
PADDED = ((1000, 1024), (100, 256))


def _real_rows(vocab: int, shard: torch.Tensor, tp_rank: int) -> int:
    return min(max(vocab - tp_rank * shard.shape[0], 0), shard.shape[0])


def _engine_config(vocab: int):
    """The test engine's config of the tiny Llama (tests/_engine.py)."""
    import _engine
    import _megatron_hf as mh

    return _engine.Config(vocab=vocab, hidden=mh.HIDDEN, layers=mh.LAYERS, heads=mh.HEADS, kv_heads=mh.GROUPS,
                          head_dim=mh.HIDDEN // mh.HEADS, inter=mh.FFN)


def _padded_refit(rank: int, world: int, checkpoint: str) -> dict:
    import _engine
    import _megatron_hf as mh
    import torch.distributed as dist
    from transformers.core_model_loading import revert_weight_conversion

    import reshard_ext as rx
    from reshard_ext.adapters.hf_names import HFNames

    out: dict = {}
    for vocab, padded in PADDED:
        src = mh.build_megatron("llama", tp=TP, pp=PP, seed=1, vocab=padded)
        mg = mh.gathered(src)
        megatron_logits = mh.megatron_logits(src, vocab=vocab)
        dst = mh.build_hf("llama", vocab=vocab) if rank == 0 else None
        # the vocabulary on every rank: a HF config, or HFNames (ranks 1-3 see no HF model)
        spec = mh.hf_config("llama", vocab=vocab) if vocab == 1000 else HFNames(vocab_size=vocab)
        rx.swap_model_weights(src, dst, hf_names=spec)
        # And back into a zeroed Megatron model: real rows land, padding rows stay untouched (zero).
        back = mh.build_megatron("llama", tp=TP, pp=PP, seed=2, vocab=padded)
        with torch.no_grad():
            for t in back.state_dict().values():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.zero_()
        rx.swap_model_weights(dst, back, hf_names=spec)
        differ, tp_rank = [], src.pg_collection.tp.rank()
        theirs = back.state_dict()
        for name, t in src.state_dict().items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            got = theirs[name]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                real = _real_rows(vocab, t, tp_rank)
                if not (torch.equal(t[:real], got[:real]) and not got[real:].any()):
                    differ.append(name)
            elif not torch.equal(t, got):
                differ.append(name)
        case: dict = {"megatron_logits": megatron_logits, "back_differ": differ}
        if dst is not None:
            assert mg is not None
            want = mh.reference(mg, "llama")
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                want[name] = want[name][:vocab]
            got = revert_weight_conversion(dst, dict(dst.state_dict()))
            got = {k: (v[0] if isinstance(v, list) else v) for k, v in got.items()}
            case["keys"] = sorted(set(want) ^ set(got))
            case["differ"] = sorted(k for k in want if k in got and not torch.equal(want[k], got[k]))
            case["hf_logits"] = mh.hf_logits(dst)
        if vocab == 1000:
            # Into a vLLM-style engine at TP4 (which pads 1000 to 1024 its own way: 256 a
            # rank), traced from its loader; the reference is its loader fed the HF tensors.
            cfg = _engine_config(vocab)
            # No hf_names: the family and the vocabulary come from the engine's HF config, its
            # tensor list from its checkpoint's headers (as vLLM models carry them).
            engine = _engine.Engine(cfg, rank, world)
            engine.config = mh.hf_config("llama", vocab=vocab)
            engine.config._name_or_path = checkpoint
            rx.swap_model_weights(src, engine)
            box = [case.get("keys") is not None and want]
            dist.broadcast_object_list(box, src=0)
            ref = _engine.Engine(cfg, rank, world)
            ref.load_weights(box[0].items())
            mine, theirs = dict(engine.named_parameters()), dict(ref.named_parameters())
            case["engine_differ"] = [n for n in theirs if not torch.equal(mine[n], theirs[n])]
        out[vocab] = case
        rx.clear_caches()
    # A HF vocabulary larger than Megatron's padded one: not a padding; every rank raises.
    src = mh.build_megatron("llama", tp=TP, pp=PP, seed=1, vocab=1024)
    try:
        rx.swap_model_weights(src, mh.build_hf("llama", vocab=1100) if rank == 0 else None,
                              hf_names=mh.hf_config("llama", vocab=1100))
        out["error"] = None
    except rx.ReshardError as e:
        out["error"] = str(e)
    rx.clear_caches()
    return out


def test_padded_vocabulary_into_transformers_and_an_engine(tmp_path) -> None:
    """Megatron TP2 x PP2 with a padded vocabulary (1000 -> 1024; 100 -> 256, TP rank 1
    only padding) into a transformers model, back into a zeroed Megatron model (padding
    rows untouched) and into a vLLM-style engine at TP4; a larger HF vocabulary raises."""
    import _engine

    safetensors = pytest.importorskip("safetensors.torch")
    cfg = _engine_config(1000)
    safetensors.save_file({n: torch.zeros(s) for n, s in _engine.hf_shapes(cfg).items()},
                          str(tmp_path / "model.safetensors"))  # the engine's checkpoint: only its headers are read
    results = run_ranks(4, _padded_refit, str(tmp_path), timeout=600)
    first = results[0]
    for vocab, _ in PADDED:
        assert [r[vocab]["back_differ"] for r in results] == [[]] * 4, [r[vocab]["back_differ"] for r in results]
        case = first[vocab]
        assert case["keys"] == [] and case["differ"] == [], (case["keys"][:5], case["differ"][:5])
        megatron_logits = results[TP * (PP - 1)][vocab]["megatron_logits"][..., :vocab]
        diff = float((case["hf_logits"] - megatron_logits).abs().max())
        assert torch.allclose(case["hf_logits"], megatron_logits, rtol=1e-4, atol=1e-4), diff
    assert [r[1000]["engine_differ"] for r in results] == [[]] * 4, [r[1000]["engine_differ"] for r in results]
    for r in results:
        assert r["error"] is not None and "1100 tokens" in r["error"] and "1024" in r["error"], r["error"]


def _mtp_refit(rank: int, world: int) -> dict:
    """DeepSeek-V3 with one MTP layer (TP2 x PP2 x EP2; MTP and a copy of the embeddings
    on the last stage) into a plain HF checkpoint dict on rank 0 (transformers'
    DeepseekV3 drops MTP layers), then that dict back into a zeroed Megatron model."""
    import _megatron_hf as mh

    import reshard_ext as rx
    from reshard_ext.adapters import megatron_hf

    src = mh.build_megatron("deepseek_v3", tp=TP, pp=PP, ep=2, seed=1, mtp=1)
    mg = mh.gathered(src)
    want = mh.reference(mg, "deepseek_v3") if mg is not None else {}
    dst = {n: (torch.zeros_like(t), rx.Layout(tuple(t.shape), t.dtype, rx.Mesh([0]), [rx.Replicate()]))
           for n, t in want.items()}
    rx.execute(rx.plan(megatron_hf.entries(src, hf_names="deepseek_v3"), dst))
    out: dict = {"differ": sorted(n for n, (t, _) in dst.items() if not torch.equal(t, want[n]))}
    back = mh.build_megatron("deepseek_v3", tp=TP, pp=PP, ep=2, seed=2, mtp=1)
    with torch.no_grad():
        for t in back.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.zero_()
    rx.execute(rx.plan(dst, megatron_hf.entries(back, hf_names="deepseek_v3", tie_output_to_embedding=False)))
    theirs = back.state_dict()
    out["back_differ"] = sorted(n for n, t in src.state_dict().items()
                                if isinstance(t, torch.Tensor) and not torch.equal(t, theirs[n]))
    out["mtp_names"] = sorted(n for n in want if n.startswith(f"model.layers.{mh.LAYERS}."))
    rx.clear_caches()
    return out


def test_deepseek_v3_mtp_tp2_pp2_into_a_checkpoint() -> None:
    """Every HF tensor of the checkpoint, MTP layer 4 included (enorm, hnorm, eh_proj,
    shared_head.norm/head, embed_tokens, its MLA attention and MoE), equals the gathered
    Megatron weights converted by hand, bit for bit; and back, every stage's tensors
    (the last stage's copy of the embeddings too) equal the source's."""
    results = run_ranks(4, _mtp_refit, timeout=600)
    assert [r["back_differ"] for r in results] == [[]] * 4, [r["back_differ"][:3] for r in results]
    first = results[0]
    assert first["differ"] == [], first["differ"][:5]
    mtp = first["mtp_names"]
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                 "self_attn.kv_b_proj", "mlp.experts.3.up_proj", "mlp.shared_experts.down_proj"):
        assert f"model.layers.4.{name}.weight" in mtp, (name, mtp)
