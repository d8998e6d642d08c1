"""An engine that stores block-FP8 weights (tests/_engine_fp8.py: vLLM's ``weight`` +
``weight_scale_inv`` per 128x128 block, TP-sharded alike) refitted from a BF16 trainer in
one execute: EngineEntries.pair_scales joins each traced weight with its traced scales,
rx.FP8Block quantizes on the way (sender or receiver side). The reference is the engine's
own load_weights given an FP8 checkpoint made by an independent quantization of the global
BF16 tensors (DeepSeek-V3's per_block_cast_to_fp8 recipe, test_fp8block_kernels); every
engine parameter must equal it bit for bit, on two executes with new trainer weights."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _engine_fp8 import E4M3, Engine, hf_shapes
from test_fp8block_kernels import ref_fp8block

import reshard_ext as rx
from reshard_ext.engines import EngineEntries, decide, trace_loader
from reshard_ext.layout import Layout, Mesh, Shard

WEIGHTS = [f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]


def _bf16(seed: int) -> dict[str, torch.Tensor]:
    """The trainer's global BF16 tensors (blocks of varied magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in WEIGHTS:
        shape = hf_shapes()[name][0]
        scale = torch.exp2(torch.randint(-8, 8, (shape[0] // 128, 1, shape[1] // 128, 1), generator=g).float())
        x = torch.randn(shape[0] // 128, 128, shape[1] // 128, 128, generator=g) * scale
        out[name] = x.reshape(shape).to(torch.bfloat16)
    return out


def _fp8_checkpoint(bf16: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, x in bf16.items():
        data, scale_inv = ref_fp8block(x, "fp32")
        out[name], out[name + "_scale_inv"] = data.view(E4M3), scale_inv
    return out


def _refit(rank: int, world: int, where: str) -> list[list[str]] | None:
    trainers, engine_ranks = [0, 1], [2, 3]
    sub = dist.new_group(engine_ranks)
    src = {}
    for name in WEIGHTS:
        layout = Layout(hf_shapes()[name][0], torch.bfloat16, Mesh(trainers), [Shard(0)])
        if rank in trainers:
            src[name] = (layout.local_part(_bf16(0)[name], rank).clone(), layout)
    dst, model = None, None
    if rank in engine_ranks:
        model = Engine(rank - 2, 2)
        dst = rx.adapters.engine.entries(model, rank_offset=2, weights=hf_shapes(), engine_group=sub)
        assert dst.pair_scales() == WEIGHTS
        assert dst.pair_scales() == WEIGHTS  # again: nothing changes
        assert sorted(dst) == sorted(WEIGHTS) and all(isinstance(t, tuple) for t, _ in dst.values())
        again = dst.rebound()  # the same parameters: rebound entries come paired too
        assert sorted(again) == sorted(WEIGHTS) and all(isinstance(t, tuple) for t, _ in again.values())
    plan = rx.plan(src, dst, transform=rx.FP8Block(WEIGHTS, where=where))
    out = []
    for seed in (0, 1):
        new = _bf16(seed)
        for name, (t, layout) in src.items():
            t.copy_(layout.local_part(new[name], rank))
        rx.execute(plan)
        if dst is not None and model is not None:
            dst.finish()
            ref = Engine(rank - 2, 2)
            ref.load_weights(_fp8_checkpoint(new).items())
            got, want = dict(model.named_parameters()), dict(ref.named_parameters())
            out.append([n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))])
    return out if dst is not None else None


@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_bf16_trainer_into_fp8_engine(where):
    results = run_ranks(4, _refit, where)
    assert results[:2] == [None, None]
    assert results[2:] == [[[], []], [[], []]]


def test_scales_not_on_the_block_grid_raise():
    """down_proj's scales loaded whole on every rank (not its blocks' slice): pairing it
    would misplace scales, so pair_scales names it on every engine rank."""
    specs = {n: s for n, s in hf_shapes().items()}
    models = [Engine(r, 2, whole_scales=True) for r in range(2)]
    traces = [trace_loader(m, specs) for m in models]
    decisions = decide([t.summary() for t in traces], specs)
    for r, (m, t) in enumerate(zip(models, traces)):
        entries = EngineEntries(m, t, decisions, r)
        with pytest.raises(rx.ReshardError, match="mlp.down_proj.weight_scale_inv"):
            entries.pair_scales()


def _swap_colocated(rank: int, world: int, path: str) -> list:
    """Trainer and engine in the same 2 processes: swap_model_weights finds the engine by its
    load_weights, the tensor list in its FP8 checkpoint's headers, and pairs the scales
    itself because the transform is an rx.FP8Block."""
    import types

    model = Engine(rank, world)
    model.config = types.SimpleNamespace(_name_or_path=path)
    out = []
    for seed in (0, 1):
        new = _bf16(seed)
        src = {}
        for name in WEIGHTS:
            layout = Layout(hf_shapes()[name][0], torch.bfloat16, Mesh(list(range(world))), [Shard(1)])
            src[name] = (layout.local_part(new[name], rank).clone(), layout)
        rx.swap_model_weights(src, model, transform=rx.FP8Block(WEIGHTS, where="sender"), verify=True)
        ref = Engine(rank, world)
        ref.load_weights(_fp8_checkpoint(new).items())
        got, want = dict(model.named_parameters()), dict(ref.named_parameters())
        out.append([n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))])
    return out


def test_swap_model_weights_pairs_a_colocated_fp8_engine(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file(_fp8_checkpoint(_bf16(0)), str(tmp_path / "model.safetensors"))
    assert run_ranks(2, _swap_colocated, str(tmp_path)) == [[[], []], [[], []]]
