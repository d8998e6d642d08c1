"""Megatron adapter: every entry's layout, applied to the logical tensor, gives exactly
the local tensor the model holds (virtual PP chunks, experts, packed blocks); name maps."""
from __future__ import annotations

from typing import Any

import torch
from _dist import run_ranks
from _models import GPT, Config, fill, global_tensor, make_groups


def _vpp_layouts(rank: int, world: int) -> Any:
    from reshard_ext.adapters import megatron

    cfg = Config(layers=4, num_moe_experts=4)
    pg = make_groups(world, 0, tp=1, pp=2, dp=1)
    chunks = [GPT(cfg, pg, layer_ids=[pg.stage + 2 * c]) for c in range(2)]  # virtual PP: interleaved layers
    for c in chunks:  # Megatron: embedding only in the first chunk, head only in the last
        fill(c, 3)
    for attr, keep in (("embedding", 0), ("output_layer", 1)):
        if hasattr(chunks[1 - keep], attr):
            delattr(chunks[1 - keep], attr)
    if hasattr(chunks[0].decoder, "final_layernorm"):
        del chunks[0].decoder.final_layernorm
    entries = megatron.entries(chunks)
    bad = [n for n, (t, lay) in entries.items()
           if not torch.equal(lay.local_part(global_tensor(n, lay.shape, 3, lay.dtype), rank), t)]
    return sorted(n for n in entries if n.startswith("decoder.layers.") and n.endswith("linear_fc1.weight0")), bad


def test_virtual_pp_global_names_and_layouts() -> None:
    (names0, bad0), (names1, bad1) = run_ranks(2, _vpp_layouts)
    assert bad0 == [] and bad1 == []
    assert names0 == ["decoder.layers.0.mlp.experts.linear_fc1.weight0",
                      "decoder.layers.2.mlp.experts.linear_fc1.weight0"]
    assert names1 == ["decoder.layers.1.mlp.experts.linear_fc1.weight0",
                      "decoder.layers.3.mlp.experts.linear_fc1.weight0"]


def _packed(rank: int, world: int) -> Any:
    import torch.distributed as dist
    from torch import nn

    from reshard_ext.adapters import megatron

    class Core(nn.Module):
        pass

    core = Core()
    core.pg_collection = type("PG", (), {"tp": dist.group.WORLD})()
    blocks = (4, 2, 6)  # global block sizes; each block split over TP2
    full = torch.arange(sum(blocks) * 3, dtype=torch.float32).reshape(-1, 3)
    starts = [0, 4, 6]
    local = torch.cat([full[s + rank * b // 2: s + (rank + 1) * b // 2] for s, b in zip(starts, blocks)])
    core.in_proj = nn.Parameter(local.clone(), requires_grad=False)
    core.in_proj.tensor_model_parallel, core.in_proj.partition_dim = True, 0
    core.in_proj.partition_sizes = [b // 2 for b in blocks]  # Megatron: per-rank sizes
    t, lay = megatron.entries(core)["in_proj"]
    return torch.equal(lay.local_part(full, rank), t)


def test_partition_sizes_become_blocks() -> None:
    assert all(run_ranks(2, _packed))


def _renamed(rank: int, world: int) -> Any:
    from reshard_ext.adapters import apply_name_map, megatron, regex_name_map
    from reshard_ext.swap import clear_caches, swap_model_weights

    clear_caches()
    rules = [(r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(.*)", r"model.layers.\1.self_attn.qkv_proj.\2")]
    src = GPT(Config(), make_groups(world, 0, tp=2, pp=1, dp=1))
    dst = GPT(Config(), make_groups(world, 0, tp=1, pp=1, dp=2))
    fill(src, 4)
    engine = apply_name_map(megatron.entries(dst, tie_output_to_embedding=False), regex_name_map(rules))
    swap_model_weights(src, engine, name_map=regex_name_map(rules))
    w = dst.decoder.layers[0].self_attention.linear_qkv.weight
    return "model.layers.0.self_attn.qkv_proj.weight" in engine and torch.equal(w, global_tensor(
        "decoder.layers.0.self_attention.linear_qkv.weight", tuple(w.shape), 4))


def test_name_map_to_engine_names() -> None:
    assert all(run_ranks(2, _renamed))
