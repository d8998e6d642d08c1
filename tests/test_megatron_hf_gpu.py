"""test_megatron_hf in bfloat16 on GPUs: the tiny Llama, Qwen3-MoE and DeepSeek-V3
Megatron-Core GPTModels (local spec) and the matching `transformers` models in bf16 on
CUDA, one process per GPU over NCCL, refit through `rx.swap_model_weights` into the
transformers model on rank 0. Layout by world size: 1 GPU TP1, 2 GPUs TP2 (EP2 for the
MoE ones), 4 GPUs TP2·PP2 (EP2), each family at every world size the machine has.

Every transformers checkpoint tensor equals the independent conversion of the gathered
Megatron weights bit for bit, and the logits on fixed ids match the Megatron model's
within the tolerance below. RX_TEST_HF_DEVICE=cpu runs the same bf16 test on the CPU
over gloo (world sizes 1, 2, 4), to check the test itself where there is no GPU.
Skipped without CUDA (unless forced to the CPU), megatron-core or transformers."""
from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed")
pytest.importorskip("transformers", reason="transformers not installed")

from _dist import run_ranks  # noqa: E402

DEVICE = os.environ.get("RX_TEST_HF_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
GPUS = torch.cuda.device_count() if DEVICE == "cuda" else 0
# world size -> (TP, PP, EP of the MoE families)
LAYOUTS = {1: (1, 1, 1), 2: (2, 1, 2), 4: (2, 2, 2)}
BATCH = 8  # 64 token positions: enough for the argmax-agreement fraction to mean something
# Weights drawn with std 0.1: at Megatron's default 0.02 the embeddings dominate the
# residual stream, and a swapped gate/up moves the logits by little more than bf16's noise.
INIT_STD = 0.1
# Every token goes to every expert: in bf16 the two implementations round the router's
# logits differently, so a near-tie in a top-2 choice can pick another expert for a token
# on one side only, an O(1) change that is no conversion error. The fp32 CPU test covers
# the top-2 choice; here the router weights, expert order and combine are still checked.
TOPK = 4
# Tolerance, relative to the standard deviation of the fp32 reference logits (the
# transformers model upcast to fp32, whose function the fp32 CPU test ties to Megatron's
# to 1e-4). bf16 keeps 8 significant bits (relative rounding 2^-9), and Megatron's local
# layers and transformers' eager ones round at different points (RMSNorm in bf16 vs
# fp32, one fused qkv GEMM vs three, TP partial sums reduced in bf16, the softmax's
# dtype) over 4 layers: the two sides differ by about a percent of the logits' spread on
# average and some percent at the worst logit. A conversion error (q heads or gate/up
# swapped, a weight transposed, two norms exchanged) moves them by tens of percent on
# average: MEAN is the check that separates the two, MAX bounds every logit (also each
# bf16 model against the fp32 reference), ARGMAX the share of positions whose top token
# agrees (near-ties among 128 random logits flip a few).
TOL_MAX, TOL_MEAN, TOL_ARGMAX = 0.25, 0.04, 0.85


def _refit_bf16(rank: int, world: int, family: str, device: str) -> dict:
    import _megatron_hf as mh

    import reshard_ext as rx

    tp, pp, ep = LAYOUTS[world]
    ep = ep if family != "llama" else 1
    numerics = dict(dtype=torch.bfloat16, device=device, topk=TOPK)
    src = mh.build_megatron(family, tp=tp, pp=pp, ep=ep, seed=1, init_std=INIT_STD, **numerics)
    mg = mh.gathered(src)
    out: dict = {"megatron_logits": mh.megatron_logits(src, BATCH)}
    dst = mh.build_hf(family, **numerics) if rank == 0 else None
    rx.swap_model_weights(src, dst, hf_names=family)
    if dst is not None:
        assert mg is not None
        want, got = mh.reference(mg, family), mh.hf_checkpoint(dst)
        out["missing"] = sorted(set(want) - set(got))
        out["extra"] = sorted(set(got) - set(want))
        # the conversion casts where the two sides keep a tensor in other dtypes
        # (DeepSeek-V3's router in fp32 on the HF side)
        out["differ"] = sorted(k for k in want if k in got and not torch.equal(want[k].to(got[k].dtype), got[k]))
        out["hf_logits"] = mh.hf_logits(dst, BATCH)
        out["fp32_logits"] = mh.hf_logits(copy.deepcopy(dst).float(), BATCH)
    rx.clear_caches()
    return out


def _agreement(hf: torch.Tensor, megatron: torch.Tensor, fp32: torch.Tensor) -> dict[str, float]:
    scale = float(fp32.std())
    return {"max": float((hf - megatron).abs().max()) / scale, "mean": float((hf - megatron).abs().mean()) / scale,
            "argmax": float((hf.argmax(-1) == megatron.argmax(-1)).float().mean()),
            "hf_vs_fp32": float((hf - fp32).abs().max()) / scale,
            "megatron_vs_fp32": float((megatron - fp32).abs().max()) / scale}


@pytest.mark.gpu
@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_megatron_into_transformers_bf16(family: str, world: int) -> None:
    if DEVICE not in ("cuda", "cpu"):
        pytest.skip("needs CUDA (or RX_TEST_HF_DEVICE=cpu)")
    if DEVICE == "cuda" and GPUS < world:
        pytest.skip(f"needs {world} GPUs")
    tp, pp, _ = LAYOUTS[world]
    results = run_ranks(world, _refit_bf16, family, DEVICE, backend="nccl" if DEVICE == "cuda" else "gloo",
                        timeout=600)
    first = results[0]
    megatron_logits = results[tp * (pp - 1)]["megatron_logits"]  # the last stage's first rank
    assert megatron_logits is not None
    got = _agreement(first["hf_logits"], megatron_logits, first["fp32_logits"])
    print(f"bf16 logits {family} world {world} ({DEVICE}): " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
    problems = []
    if first["missing"] or first["extra"] or first["differ"]:
        problems.append(f"parameters: missing {first['missing'][:3]}, extra {first['extra'][:3]}, "
                        f"differ {first['differ'][:3]}")
    for key, bound in (("max", TOL_MAX), ("mean", TOL_MEAN), ("hf_vs_fp32", TOL_MAX), ("megatron_vs_fp32", TOL_MAX)):
        if not got[key] <= bound:
            problems.append(f"logits: {key} {got[key]:.4f} > {bound} (relative to the fp32 logits' std)")
    if not got["argmax"] >= TOL_ARGMAX:
        problems.append(f"logits: argmax agrees at {got['argmax']:.3f} of positions < {TOL_ARGMAX}")
    assert not problems, problems
