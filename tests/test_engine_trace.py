"""Engine destinations traced from the engine's own loader (reshard_ext.engines).

The engine is tests/_engine.py (vLLM's parameter conventions). The reference is always
the engine's own load_weights given the Hugging Face tensors; a refit through the traced
record must equal it bit for bit, at TP 1, 2, 4 and 8, with tied and padded vocabularies,
KV-head replication, fused checkpoints, MoE with TP-sharded and expert-parallel experts,
and loaders with steps outside the traced set (the safe path).

Engine ranks are simulated in one process where only the loader's TP rank matters (the
pure trace -> decide -> entries path; "executing" writes each entry's layout.local_part);
real multi-process refits (gloo) run rx.plan / rx.execute / rx.swap_model_weights.
"""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.distributed as dist
from _cases import bits_equal
from _dist import run_ranks
from _engine import Config, Engine, hf_weights

import reshard_ext as rx
from reshard_ext import ReshardError
from reshard_ext.adapters import hf_names
from reshard_ext.engines import EngineEntries, decide, read_checkpoint, specs_of, trace_loader
from reshard_ext.engines.boxes import locate
from reshard_ext.engines.layouts import infer
from reshard_ext.layout import Layout, Mesh, Replicate, Shard


def _traced(cfg: Config, tp: int, hf: dict[str, torch.Tensor]) -> list[EngineEntries]:
    """Every engine rank's entries, the ranks simulated in this process."""
    specs = specs_of(hf)
    models = [Engine(cfg, r, tp) for r in range(tp)]
    traces = [trace_loader(m, specs) for m in models]
    decisions = decide([t.summary() for t in traces], specs)
    return [EngineEntries(m, t, decisions, r) for r, (m, t) in enumerate(zip(models, traces))]


def _land(entries: EngineEntries, hf: dict[str, torch.Tensor]) -> None:
    """What rx.execute delivers (each entry's piece of the logical tensor), then finish()."""
    for name, (view, layout) in entries.items():
        view.copy_(layout.local_part(hf[name], entries.rank).to(view.dtype))
    entries.finish()


def _mismatches(model: Engine, cfg: Config, rank: int, tp: int, hf: dict[str, torch.Tensor]) -> list[str]:
    ref = Engine(cfg, rank, tp)
    ref.load_weights(hf.items())
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    return [n for n in got if not bits_equal(got[n].cpu(), want[n])]


CONFIGS = {
    "dense": Config(),
    "tied-bias": Config(tie=True, qkv_bias=True, vocab=1000),
    "small-vocab": Config(vocab=65),  # padded to 128: at TP8 ranks 5-7 hold no real row
    "fused": Config(fused=True, kv_heads=8),  # no KV replication up to TP8 (that case: the safe path, below)
    "moe": Config(experts=4, kv_heads=4, tie=True),
    "moe-ep": Config(experts=8, ep=True, kv_heads=4),
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_traced_refit_equals_the_engines_loader(case, tp):
    cfg = CONFIGS[case]
    hf = hf_weights(cfg)
    ranks = _traced(cfg, tp, hf)
    for e in ranks:
        assert not e.safe, e.report()
        # The trace wrote nothing of the weights: traced regions are still stale.
        assert all(torch.isnan(view).all() for view, _ in e.values())
        _land(e, hf)
    for e in ranks:
        assert _mismatches(e.model, cfg, e.rank, tp, hf) == []


def test_layouts_follow_vllm():
    cfg = Config(vocab=1000, kv_heads=2)
    e = _traced(cfg, 4, hf_weights(cfg))[3]
    _, embed = e["model.embed_tokens.weight"]
    assert embed.placements == (Shard(0, sizes=(256, 256, 256, 232)),)
    _, k = e["model.layers.0.self_attn.k_proj.weight"]  # 2 KV heads on 4 ranks: each on 2 of them
    assert k.mesh == Mesh([[0, 1], [2, 3]]) and k.placements == (Shard(0), Replicate())
    assert e["model.layers.0.self_attn.o_proj.weight"][1].placements == (Shard(1),)
    view, norm = e["model.norm.weight"]
    assert norm.placements == (Replicate(),) and norm.mesh == Mesh([0, 1, 2, 3])
    cfg = Config(fused=True, kv_heads=4)
    _, gate_up = _traced(cfg, 2, hf_weights(cfg))[1]["model.layers.1.mlp.gate_up_proj.weight"]
    assert gate_up.placements == (Shard(0, stride=2),)  # [gate_r; up_r] from one fused tensor
    cfg = Config(experts=4, ep=True)
    _, expert = _traced(cfg, 2, hf_weights(cfg))[1]["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert expert.mesh == Mesh([1]) and expert.placements == (Replicate(),)


def test_padding_rows_are_the_loaders_zeros():
    cfg = Config(vocab=1000)
    e = _traced(cfg, 2, hf_weights(cfg))[1]
    pad = e.model.model.embed_tokens.weight[488:]
    assert pad.shape[0] == 24 and torch.equal(pad, torch.zeros_like(pad))
    assert [f.value for f in e.fills] == [0, 0]  # embed_tokens and lm_head


ODD_SAFE = {
    "scale": ("input_layernorm.weight", "aten.mul"),
    "item": ("o_proj.weight", "reads its values"),
    "temp": ("proj.weight", "not a parameter or buffer"),
    "permute": ("q_proj.weight", "not a view of the weight"),
    "cat": ("_proj.weight", "aten.cat"),
    "half": ("input_layernorm.weight", "casts torch.float32 to torch.float16"),
    "plus-one": ("input_layernorm.weight", "also writes"),
    "readback": ("layernorm.weight", "reads back|also writes"),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("odd", sorted(ODD_SAFE))
def test_unsupported_step_takes_the_safe_path(odd, tp):
    cfg = Config(odd=odd, qkv_bias=True)
    hf = hf_weights(cfg)
    ranks = _traced(cfg, tp, hf)
    suffix, why = ODD_SAFE[odd]
    safe = ranks[0].safe
    assert safe and all(n.endswith(suffix) and re.search(why, reason) for n, reason in safe.items()), safe
    expected = {"scale": 2, "item": 2, "temp": 4, "permute": 2, "cat": 4, "half": 2, "plus-one": 2, "readback": 4}[odd]
    assert len(safe) == expected
    for e in ranks:
        assert e.safe == safe and set(e.scratch) == set(safe)
        for name in safe:  # received whole on every rank that uses it
            assert e[name][1] == Layout(hf[name].shape, hf[name].dtype, Mesh(list(range(tp))), [Replicate()])
        _land(e, hf)
    for e in ranks:
        assert _mismatches(e.model, cfg, e.rank, tp, hf) == []


def test_fused_qkv_with_replicated_kv_heads_takes_the_safe_path():
    cfg = Config(fused=True, kv_heads=2)  # TP4: q split 4 ways, k/v 2 ways in one HF tensor: no rx.Layout
    hf = hf_weights(cfg)
    ranks = _traced(cfg, 4, hf)
    assert set(ranks[0].safe) == {f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)}
    assert "no split rx.Shard describes" in ranks[0].safe["model.layers.0.self_attn.qkv_proj.weight"]
    for e in ranks:
        _land(e, hf)
        assert _mismatches(e.model, cfg, e.rank, 4, hf) == []


def test_loader_that_fails_on_real_tensors_raises():
    cfg = Config(odd="raises")
    with pytest.raises(ReshardError, match="post_attention_layernorm.weight' given as a real tensor"):
        _traced(cfg, 2, hf_weights(cfg))


def test_loader_that_replaces_parameters_raises():
    cfg = Config(odd="replace")
    with pytest.raises(ReshardError, match=r"replaced or resized parameters \['model.norm.weight'\]"):
        _traced(cfg, 1, hf_weights(cfg))


def test_rebound_entries_write_into_reallocated_parameters():
    cfg = Config(vocab=1000)
    hf = hf_weights(cfg)
    e = _traced(cfg, 2, hf)[1]
    for p in e.model.parameters():  # the engine frees and reallocates its weights (same shapes)
        p.data = torch.full_like(p, float("nan"))
    assert len(e.stale()) == len(list(e.model.parameters()))
    with pytest.raises(ReshardError, match="were replaced since the plan bound them"):
        e.finish()
    fresh = e.rebound()
    assert fresh.stale() == [] and {n: l for n, (_, l) in fresh.items()} == {n: l for n, (_, l) in e.items()}
    _land(fresh, hf)
    assert _mismatches(e.model, cfg, 1, 2, hf) == []


# --- geometry -------------------------------------------------------------------------

CHAINS = {
    "narrow": (lambda x: x.narrow(0, 2, 3), True),
    "transpose": (lambda x: x[:, 1:3].transpose(0, 1), True),
    "flatten rows": (lambda x: x.reshape(24, 5)[5:7], True),
    "whole rows of a flat view": (lambda x: x.reshape(-1)[20:60], True),
    "permute": (lambda x: x.permute(2, 0, 1)[1:4], True),
    "select": (lambda x: x[3, 1, 2:4], True),
    "unflatten": (lambda x: x.reshape(2, 3, 4, 5)[1, 1:], True),
    "chunk": (lambda x: x.chunk(3, 1)[1], True),
    "split": (lambda x: x.split([1, 4], 2)[1].t() if x.dim() == 2 else x.split([1, 4], 2)[1], True),
    "unsqueeze": (lambda x: x[2:4].unsqueeze(1), True),
    "expand size-1": (lambda x: x[2:3].expand(1, 4, 5), True),
    "step": (lambda x: x[:, :, ::2], False),
    "wrap": (lambda x: x.reshape(-1)[20:45], False),
    "diagonal": (lambda x: x[0, :4, :4].diagonal(), False),
    "broadcast": (lambda x: x[0:1].expand(3, 4, 5), False),
    "interleave": (lambda x: x.reshape(6, 2, 2, 5).transpose(1, 2)[1], False),
    "split dim kept in order": (lambda x: x.reshape(6, 2, 2, 5)[1], True),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_locate_finds_the_box_a_slice_reads(chain):
    fn, is_box = CHAINS[chain]
    shape = (6, 4, 5)
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    want = fn(x)
    meta = fn(torch.empty(shape, dtype=torch.float64, device="meta"))
    dst = torch.full(want.shape, -1.0, dtype=torch.float64)
    found = locate(shape, meta.storage_offset(), tuple(meta.shape), meta.stride(), dst.stride())
    assert isinstance(found, str) != is_box, found
    if is_box:
        box, sizes, strides = found
        view = dst.as_strided(sizes, strides, 0)
        view.copy_(x[tuple(slice(s, s + n) for ((s, n),) in box)])
        assert torch.equal(dst, want)


def test_infer_names_every_split_kind():
    f = torch.float32
    assert infer((8, 2), f, {0: (((0, 4),), ((0, 2),)), 1: (((4, 4),), ((0, 2),))}).placements == (Shard(0),)
    assert infer((9, 2), f, {0: (((0, 8),), ((0, 2),)), 1: (((8, 1),), ((0, 2),))}).placements == \
        (Shard(0, sizes=(8, 1)),)
    strided = infer((8,), f, {0: (((0, 2), (4, 2)),), 1: (((2, 2), (6, 2)),)})
    assert strided.placements == (Shard(0, stride=2),)
    blocks = infer((6,), f, {0: (((0, 2), (4, 1)),), 1: (((2, 2), (5, 1)),)})
    assert blocks.placements == (Shard(0, blocks=(4, 2)),)
    grid = infer((4, 4), f, {r: (((2 * (r // 2), 2),), ((2 * (r % 2), 2),)) for r in range(4)})
    assert grid.mesh == Mesh([[0, 1], [2, 3]]) and grid.placements == (Shard(0), Shard(1))
    assert "not a replicated grid" in infer((4,), f, {0: (((0, 2),),), 1: (((0, 2),),), 2: (((2, 2),),)})
    assert "no split" in infer((4,), f, {0: (((0, 2),),), 1: (((1, 3),),)})


def test_checkpoint_headers_give_names_shapes_dtypes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    hf = hf_weights(dataclasses.replace(Config(), dtype=torch.bfloat16))
    names = list(hf)
    safetensors.save_file({n: hf[n] for n in names[:5]}, str(tmp_path / "model-00001.safetensors"))
    safetensors.save_file({n: hf[n] for n in names[5:]}, str(tmp_path / "model-00002.safetensors"))
    specs = read_checkpoint(tmp_path)
    assert specs == {n: (tuple(t.shape), t.dtype) for n, t in hf.items()}


# --- real process groups ----------------------------------------------------------------


def _trainer_entries(hf: dict[str, torch.Tensor], ranks: list[int], rank: int, config: object = None) -> dict:
    """Trainer pieces: every tensor split on its last dim over the trainer ranks; with a
    Hugging Face `config`, grouped-query q/k/v in their grouped shapes (adapters.hf_names)."""
    out = {}
    for name, t in hf.items():
        layout = Layout(t.shape, t.dtype, Mesh(ranks), [Shard(-1)])
        if rank in ranks:
            out[name] = (layout.local_part(t, rank), layout)
    shape = hf_names.attention_shape(config) if config is not None else None
    return out if shape is None else hf_names.grouped_qkv(out, rank, **shape)


def _refit_two_jobs(rank: int, world: int, cfg: Config, trainers: int, device: str = "cpu") -> tuple:
    """Trainer ranks 0..trainers-1, engine ranks after them (TP world - trainers): two
    refits of the same plan, the second after the trainer's weights changed in place."""
    engine_ranks = list(range(trainers, world))
    sub = dist.new_group(engine_ranks)
    hf = hf_weights(cfg, seed=0)
    src = {n: (t.to(device), layout) for n, (t, layout) in _trainer_entries(hf, list(range(trainers)), rank).items()}
    tp = len(engine_ranks)
    dst, model = None, None
    if rank >= trainers:
        with torch.device(device):
            model = Engine(cfg, rank - trainers, tp)
        dst = rx.adapters.engine.entries(model, rank_offset=trainers, weights=hf, engine_group=sub)
    plan = rx.plan(src, dst)
    out = []
    for seed in (0, 1):
        new = hf_weights(cfg, seed=seed)
        for name, (t, layout) in src.items():
            t.copy_(layout.local_part(new[name], rank).to(device))
        rx.execute(plan)
        if dst is not None:
            dst.finish()
            out.append(_mismatches(model, cfg, rank - trainers, tp, new))
    if dst is None:
        return None
    wanted = sum(v.numel() * v.element_size() for v, _ in dst.values())
    return out, plan.bytes_received, wanted, sorted(dst.safe)


@pytest.mark.parametrize("case", ["dense-odd", "moe-ep"])
def test_refit_from_a_trainer_into_engine_tp2(case):
    cfg = {"dense-odd": Config(vocab=1000, odd="item", tie=True), "moe-ep": Config(experts=4, ep=True)}[case]
    results = run_ranks(4, _refit_two_jobs, cfg, 2)
    for got in results[2:]:
        mismatches, received, wanted, safe = got
        assert mismatches == [[], []]
        assert received == wanted  # each engine rank receives its own slices only (safe-path ones whole)
        assert safe == ([f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)] if case == "dense-odd" else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_refit_from_a_trainer_into_engine_tp2_on_gpus():
    cfg = Config(vocab=1000, odd="item", tie=True, dtype=torch.bfloat16)
    for got in run_ranks(4, _refit_two_jobs, cfg, 2, "cuda", backend="nccl")[2:]:
        mismatches, received, wanted, safe = got
        assert mismatches == [[], []] and received == wanted
        assert safe == [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)]


def _swap_colocated(rank: int, world: int, cfg: Config, path: str) -> list:
    import transformers

    """Trainer and engine in the same processes (the default engine_group: the world), the
    engine found by swap_model_weights from its load_weights, the tensor list from its
    checkpoint's headers and q/k/v grouped as its attention heads say (its Hugging Face
    config, as vLLM models carry it)."""

    model = Engine(cfg, rank, world)
    model.config = transformers.LlamaConfig(num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                                            head_dim=cfg.head_dim, hidden_size=cfg.hidden)
    model.config._name_or_path = path
    out = []
    for seed in (0, 3):
        hf = hf_weights(cfg, seed=seed)
        rx.swap_model_weights(_trainer_entries(hf, list(range(world)), rank, model.config), model)
        out.append(_mismatches(model, cfg, rank, world, hf))
    first = rx.adapters.engine.entries(model)
    out.append(first is rx.adapters.engine.entries(model))  # remembered: no second trace
    out.append(first["model.layers.0.self_attn.q_proj.weight"][1].shape)
    return out


def test_swap_model_weights_into_a_colocated_engine_tp4(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    pytest.importorskip("transformers")
    cfg = Config(vocab=1000, kv_heads=2, odd="scale")
    safetensors.save_file(hf_weights(cfg), str(tmp_path / "model.safetensors"))
    for got in run_ranks(4, _swap_colocated, cfg, str(tmp_path)):
        assert got == [[], [], True, (cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim, cfg.hidden)]
