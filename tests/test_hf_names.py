"""Hugging Face names without Megatron-Core installed: Megatron-like modules at TP2 whose
parameters carry Megatron's names and attributes (TE-fused norms, grouped-GEMM experts
``weightK`` at expert-TP2, Qwen2's q/k/v biases, a shared-expert gate, a fused MLA down
projection, tied embeddings) are described under HF names, and every entry's layout,
applied to the HF tensor (built first, then cut into Megatron's shards here by hand),
gives exactly the rank's piece. Also: the view algebra (`reshard_ext.views`) against
`Layout.local_part`, a transformers model's stacked experts as views, and the errors."""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

G, HPG, D, H, I, V, E = 2, 2, 4, 8, 6, 16, 4  # kv groups, q heads per group, head dim, hidden, ffn, vocab, experts


def _module(tensors: dict[str, tuple[torch.Tensor, dict]], config: Any, tied: bool = False) -> nn.Module:
    """A module tree holding `tensors` (Megatron name -> (local tensor, Megatron attributes)),
    with the process groups and config of a Megatron model at TP = the world."""
    import torch.distributed as dist

    root = nn.Module()
    for name, (local, attrs) in tensors.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        if attrs.get("buffer"):
            mod.register_buffer(leaf, local.clone())
            continue
        p = nn.Parameter(local.clone(), requires_grad=False)
        for k, v in attrs.items():
            setattr(p, k, v)
        mod.register_parameter(leaf, p)
    root.pg_collection = types.SimpleNamespace(tp=dist.group.WORLD)
    root.config = config
    root.share_embeddings_and_output_weights = tied
    return root


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int = 2, **extra: Any) -> tuple[torch.Tensor, dict]:
    return t.chunk(tp, dim)[rank], dict(tensor_model_parallel=True, partition_dim=dim, partition_stride=1, **extra)


def _fc1(gate: torch.Tensor, up: torch.Tensor, rank: int, stride: int, **extra: Any) -> tuple[torch.Tensor, dict]:
    """Megatron's gated fc1 shard: [gate_r; up_r] (whatever partition_stride says)."""
    local = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
    return local, dict(tensor_model_parallel=True, partition_dim=0, partition_stride=stride, **extra)


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int) -> tuple[torch.Tensor, dict]:
    """Megatron's linear_qkv shard: its query groups, each [q heads; k; v]."""
    rows = []
    for g in range(rank * G // 2, (rank + 1) * G // 2):
        rows += [q.view(G, HPG * D, *q.shape[1:])[g], k.view(G, D, *k.shape[1:])[g], v.view(G, D, *v.shape[1:])[g]]
    return torch.cat(rows), dict(tensor_model_parallel=True, partition_dim=0, partition_stride=1)


def _dense_case(rank: int, gen: torch.Generator) -> tuple[dict, dict, Any, Any]:
    """Qwen2-style dense (q/k/v biases), TE spec (norms fused into linear_qkv / linear_fc1), tied head."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    hf = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
    mg: dict[str, tuple[torch.Tensor, dict]] = {
        "embedding.word_embeddings.weight": _shard(hf["model.embed_tokens.weight"], 0, rank),
        "decoder.final_layernorm.weight": (hf["model.norm.weight"], {}),
    }
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # tied: offered under the head's name too
    for i in range(2):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        t = {n: r(*s) for n, s in (("q", (G * HPG * D, H)), ("k", (G * D, H)), ("v", (G * D, H)),
                                   ("qb", (G * HPG * D,)), ("kb", (G * D,)), ("vb", (G * D,)),
                                   ("o", (H, G * HPG * D)), ("gate", (I, H)), ("up", (I, H)), ("down", (H, I)),
                                   ("ln1", (H,)), ("ln2", (H,)))}
        hf.update({h + "self_attn.q_proj.weight": t["q"], h + "self_attn.k_proj.weight": t["k"],
                   h + "self_attn.v_proj.weight": t["v"], h + "self_attn.q_proj.bias": t["qb"],
                   h + "self_attn.k_proj.bias": t["kb"], h + "self_attn.v_proj.bias": t["vb"],
                   h + "self_attn.o_proj.weight": t["o"], h + "mlp.gate_proj.weight": t["gate"],
                   h + "mlp.up_proj.weight": t["up"], h + "mlp.down_proj.weight": t["down"],
                   h + "input_layernorm.weight": t["ln1"], h + "post_attention_layernorm.weight": t["ln2"]})
        mg.update({m + "self_attention.linear_qkv.weight": _qkv(t["q"], t["k"], t["v"], rank),
                   m + "self_attention.linear_qkv.bias": _qkv(t["qb"], t["kb"], t["vb"], rank),
                   m + "self_attention.linear_qkv.layer_norm_weight": (t["ln1"], {}),
                   m + "self_attention.linear_proj.weight": _shard(t["o"], 1, rank),
                   m + "mlp.linear_fc1.weight": _fc1(t["gate"], t["up"], rank, stride=2 if i else 1),
                   m + "mlp.linear_fc1.layer_norm_weight": (t["ln2"], {}),
                   m + "mlp.linear_fc2.weight": _shard(t["down"], 1, rank)})
    config = types.SimpleNamespace(num_query_groups=G, num_attention_heads=G * HPG, kv_channels=D,
                                   gated_linear_unit=True, multi_latent_attention=False)
    return hf, mg, config, "qwen2"


def _moe_case(rank: int, gen: torch.Generator, family: str) -> tuple[dict, dict, Any, Any]:
    """A MoE layer: grouped-GEMM experts (weightK, expert-TP2), router, the family's shared experts."""
    from reshard_ext.adapters.hf_names import family as names_of

    names = names_of(family)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    h, m = f"model.layers.0.{names.moe_block}.", "decoder.layers.0.mlp."
    router = r(E, H)
    hf = {h + f"{names.router}.weight": router}
    mg = {m + "router.weight": (router, {}),
          "decoder.layers.0.pre_mlp_layernorm.weight": (r(H), {})}
    hf["model.layers.0.post_attention_layernorm.weight"] = mg["decoder.layers.0.pre_mlp_layernorm.weight"][0]
    gate_n, up_n, down_n = names.expert_proj
    for e in range(E):
        gate, up, down = r(I, H), r(I, H), r(H, I)
        hf.update({f"{h}experts.{e}.{gate_n}.weight": gate, f"{h}experts.{e}.{up_n}.weight": up,
                   f"{h}experts.{e}.{down_n}.weight": down})
        mg[f"{m}experts.linear_fc1.weight{e}"] = _fc1(gate, up, rank, stride=2, allreduce=False)
        mg[f"{m}experts.linear_fc2.weight{e}"] = _shard(down, 1, rank, allreduce=False)
    if names.shared_expert_gate:
        gate, up, down, sgate = r(I, H), r(I, H), r(H, I), r(1, H)
        s = f"{h}{names.shared_experts}."
        hf.update({s + "gate_proj.weight": gate, s + "up_proj.weight": up, s + "down_proj.weight": down,
                   f"{h}{names.shared_expert_gate}.weight": sgate})
        mg.update({m + "shared_experts.linear_fc1.weight": _fc1(gate, up, rank, stride=1),
                   m + "shared_experts.linear_fc2.weight": _shard(down, 1, rank),
                   m + "shared_experts.gate_weight": (sgate, {})})
    config = types.SimpleNamespace(num_query_groups=G, num_attention_heads=G * HPG, kv_channels=D,
                                   gated_linear_unit=True, multi_latent_attention=False, num_moe_experts=E)
    return hf, mg, config, family


def _mla_case(rank: int, gen: torch.Generator) -> tuple[dict, dict, Any, Any]:
    """MLA with TE's fused, replicated down projection [q_a; kv_a] and norms fused into the up projections."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q_lora, kv_lora, rope, heads, qk, v = 6, 4, 2, 4, 3, 3
    h, m = "model.layers.0.self_attn.", "decoder.layers.0.self_attention."
    q_a, kv_a = r(q_lora, H), r(kv_lora + rope, H)
    q_b, kv_b = r(heads * (qk + rope), q_lora), r(heads * (qk + v), kv_lora)
    hf = {h + "q_a_proj.weight": q_a, h + "kv_a_proj_with_mqa.weight": kv_a, h + "q_b_proj.weight": q_b,
          h + "kv_b_proj.weight": kv_b, h + "q_a_layernorm.weight": r(q_lora), h + "kv_a_layernorm.weight": r(kv_lora),
          "model.layers.0.input_layernorm.weight": r(H)}
    mg = {m + "linear_qkv_down_proj.weight": (torch.cat([q_a, kv_a]), {}),
          m + "linear_qkv_down_proj.layer_norm_weight": (hf["model.layers.0.input_layernorm.weight"], {}),
          m + "linear_q_up_proj.weight": _shard(q_b, 0, rank),
          m + "linear_q_up_proj.layer_norm_weight": (hf[h + "q_a_layernorm.weight"], {}),
          m + "linear_kv_up_proj.weight": _shard(kv_b, 0, rank),
          m + "linear_kv_up_proj.layer_norm_weight": (hf[h + "kv_a_layernorm.weight"], {})}
    config = types.SimpleNamespace(multi_latent_attention=True, q_lora_rank=q_lora, gated_linear_unit=True)
    return hf, mg, config, None


def _mtp_case(rank: int, gen: torch.Generator) -> tuple[dict, dict, Any, Any]:
    """One MTP layer after 2 decoder layers (HF layer 2): enorm, hnorm, eh_proj (rows over
    TP; columns [embedding | hidden] in both), its final norm as shared_head.norm, its
    inner layer; the output head and embeddings also under shared_head.head / embed_tokens."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    hf = {"model.embed_tokens.weight": r(V, H), "lm_head.weight": r(V, H)}
    h, m = "model.layers.2.", "mtp.layers.0."
    t = {n: r(*s) for n, s in (("enorm", (H,)), ("hnorm", (H,)), ("eh_emb", (H, H)), ("eh_hid", (H, H)),
                               ("norm", (H,)), ("ln1", (H,)), ("o", (H, G * HPG * D)), ("gate", (I, H)),
                               ("up", (I, H)))}
    hf.update({h + "enorm.weight": t["enorm"], h + "hnorm.weight": t["hnorm"],
               h + "eh_proj.weight": torch.cat([t["eh_emb"], t["eh_hid"]], 1), h + "shared_head.norm.weight": t["norm"],
               h + "shared_head.head.weight": hf["lm_head.weight"],
               h + "embed_tokens.weight": hf["model.embed_tokens.weight"],
               h + "input_layernorm.weight": t["ln1"], h + "self_attn.o_proj.weight": t["o"],
               h + "mlp.gate_proj.weight": t["gate"], h + "mlp.up_proj.weight": t["up"]})
    mg = {"embedding.word_embeddings.weight": _shard(hf["model.embed_tokens.weight"], 0, rank),
          "output_layer.weight": _shard(hf["lm_head.weight"], 0, rank),
          m + "enorm.weight": (t["enorm"], {}), m + "hnorm.weight": (t["hnorm"], {}),
          m + "eh_proj.weight": _shard(hf[h + "eh_proj.weight"], 0, rank),
          m + "final_layernorm.weight": (t["norm"], {}),
          m + "mtp_model_layer.input_layernorm.weight": (t["ln1"], {}),
          m + "mtp_model_layer.self_attention.linear_proj.weight": _shard(t["o"], 1, rank),
          m + "mtp_model_layer.mlp.linear_fc1.weight": _fc1(t["gate"], t["up"], rank, stride=1)}
    config = types.SimpleNamespace(gated_linear_unit=True, multi_latent_attention=False, num_layers=2,
                                   mtp_num_layers=1)
    return hf, mg, config, "deepseek_v3"


def _grouped(name: str, t: torch.Tensor) -> torch.Tensor:
    """The HF tensor in the shape the entries use (grouped q/k/v)."""
    if ".q_proj." in name and ".self_attn." in name and t.shape[0] == G * HPG * D:
        return t.view(G, HPG, D, *t.shape[1:])
    if ".k_proj." in name or ".v_proj." in name:
        return t.view(G, D, *t.shape[1:])
    return t


def _check_case(rank: int, world: int, case: str) -> dict:
    from reshard_ext.adapters import megatron_hf

    gen = torch.Generator().manual_seed(3)
    cases = {"dense": lambda: _dense_case(rank, gen), "mixtral": lambda: _moe_case(rank, gen, "mixtral"),
             "qwen2_moe": lambda: _moe_case(rank, gen, "qwen2_moe"), "mla": lambda: _mla_case(rank, gen),
             "mtp": lambda: _mtp_case(rank, gen)}
    hf, mg, config, family = cases[case]()
    model = _module(mg, config, tied=case == "dense")
    got = megatron_hf.entries(model, hf_names=family)
    wrong = sorted(n for n, (piece, lay) in got.items()
                   if n in hf and not torch.equal(lay.local_part(_grouped(n, hf[n]), rank), piece))
    return {"missing": sorted(set(hf) - set(got)), "extra": sorted(set(got) - set(hf)), "wrong": wrong}


@pytest.mark.parametrize("case", ["dense", "mixtral", "qwen2_moe", "mla", "mtp"])
def test_megatron_like_modules_under_hf_names(case: str) -> None:
    for r, res in enumerate(run_ranks(2, _check_case, case)):
        assert res == {"missing": [], "extra": [], "wrong": []}, (r, res)


def _errors(rank: int, world: int) -> list[str]:
    import reshard_ext as rx
    from reshard_ext.adapters import megatron_hf

    gen = torch.Generator().manual_seed(3)
    hf, mg, config, _ = _moe_case(rank, gen, "qwen3_moe")
    out = []
    mg["decoder.layers.0.mlp.router.expert_bias"] = (torch.zeros(E), {"buffer": True})
    mg["decoder.layers.0.self_attention.mystery.weight"] = (torch.zeros(3), {})
    for family in ("qwen3_moe", "no_such_family"):
        try:
            megatron_hf.entries(_module(mg, config), hf_names=family)
        except rx.ReshardError as e:
            out.append(str(e))
    try:
        rx.swap_model_weights(nn.Sequential(nn.Linear(2, 2)), None)
    except rx.ReshardError as e:
        out.append(str(e))
    return out


def _mtp_errors(rank: int, world: int) -> dict:
    """A HF side expecting MTP layers the Megatron model lacks (and the reverse) raises on
    every rank; a destination Megatron model offers no second names (one tensor, one name)."""
    import reshard_ext as rx
    from reshard_ext.adapters import megatron_hf
    from reshard_ext.adapters.hf_names import HFNames

    hf, mg, config, _ = _mtp_case(rank, torch.Generator().manual_seed(3))
    out: dict = {"errors": []}
    plain = {n: v for n, v in mg.items() if not n.startswith("mtp.")}
    for tensors, mtp, expected in ((plain, None, 1), (mg, 1, 2)):
        config.mtp_num_layers = mtp
        try:
            megatron_hf.entries(_module(tensors, config), hf_names=HFNames(mtp_layers=expected))
        except rx.ReshardError as e:
            out["errors"].append(str(e))
    config.mtp_num_layers = 1
    dst = megatron_hf.entries(_module(mg, config), hf_names=HFNames(mtp_layers=1), tie_output_to_embedding=False)
    out["dst_extra"] = sorted(set(hf) - set(dst))
    return out


def test_mtp_layers_the_megatron_model_lacks_raise() -> None:
    for res in run_ranks(2, _mtp_errors):
        none, fewer = res["errors"]
        assert "1 multi-token-prediction layer(s) (model.layers.2:" in none and "has none" in none, none
        assert "mtp_num_layers=1 and its mtp_block_spec" in none, none
        assert "2 multi-token-prediction layer(s) (model.layers.2..3:" in fewer and "has 1" in fewer, fewer
        assert res["dst_extra"] == ["model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]


def test_unnamed_tensors_unknown_families_and_plain_modules_raise() -> None:
    for messages in run_ranks(2, _errors):
        unnamed, family, plain = messages
        assert "mlp.router.expert_bias" in unnamed and "self_attention.mystery.weight" in unnamed, unnamed
        assert "no_such_family" in family and "qwen3_moe" in family, family
        assert "Sequential" in plain and "adapter=" in plain and "plan entries" in plain, plain


def _padded_vocab(rank: int, world: int) -> dict:
    """Megatron's embedding and output layer of 16 rows at TP2 (8 a rank), the checkpoint's
    vocabulary smaller, given three ways: the entries are the checkpoint's rows, views of
    the shards; a vocabulary larger than Megatron's raises."""
    import dataclasses

    import reshard_ext as rx
    from reshard_ext.adapters import hf_names, megatron_hf

    gen = torch.Generator().manual_seed(4)
    emb, out = torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen)
    mg = {"embedding.word_embeddings.weight": _shard(emb, 0, rank), "output_layer.weight": _shard(out, 0, rank)}
    config = types.SimpleNamespace(gated_linear_unit=True, multi_latent_attention=False)
    model = _module(mg, config)
    model.vocab_size = V  # GPTModel's (padded) vocab_size
    got: dict = {}
    for vocab, spec, explicit in ((13, "llama", 13), (13, dataclasses.replace(hf_names.family("llama"), vocab_size=13),
                                                      None), (6, {"model_type": "llama", "vocab_size": 6}, None)):
        entries = megatron_hf.entries(model, hf_names=spec, vocab_size=explicit)
        for hf, full in (("model.embed_tokens.weight", emb), ("lm_head.weight", out)):
            piece, lay = entries.get(hf, (None, None))
            want = full[:vocab]
            if lay is None:  # this rank holds only padding: no entry
                got.setdefault(vocab, []).append((hf, None))
                continue
            shared = piece.untyped_storage().data_ptr() == model.embedding.word_embeddings.weight.untyped_storage(
            ).data_ptr() or piece.untyped_storage().data_ptr() == model.output_layer.weight.untyped_storage().data_ptr()
            got.setdefault(vocab, []).append((hf, tuple(lay.shape), lay.placements[-1],
                                              torch.equal(piece, lay.local_part(want, rank)), shared))
    for bad in (V + 1, 0):
        try:
            megatron_hf.entries(model, hf_names="llama", vocab_size=bad)
        except rx.ReshardError as e:
            got.setdefault("errors", []).append(str(e))
    return got


def test_padded_vocabulary_is_the_checkpoints_rows() -> None:
    import reshard_ext as rx

    results = run_ranks(2, _padded_vocab)
    for rank, got in enumerate(results):
        for hf in ("model.embed_tokens.weight", "lm_head.weight"):
            assert (hf, (13, H), rx.Shard(0, sizes=(8, 5)), True, True) in got[13], (rank, got[13])
            assert got[13].count((hf, (13, H), rx.Shard(0, sizes=(8, 5)), True, True)) == 2  # spec and keyword alike
            # 6 rows: inside rank 0's shard, which holds them alone; rank 1 only padding
            assert ((hf, (6, H), rx.Replicate(), True, True) if rank == 0 else (hf, None)) in got[6], got[6]
        too_big, zero = got["errors"]
        assert "17 tokens" in too_big and "(16, GPTModel.vocab_size)" in too_big, too_big
        assert "positive" in zero, zero


def test_the_vocabulary_comes_from_hf_names_else_the_other_sides_config() -> None:
    """What swap_model_weights describes a Megatron model under (adapters.hf_naming): the
    vocabulary of hf_names where it names one, else of the model on the other side."""
    from reshard_ext import adapters
    from reshard_ext.adapters.hf_names import HFNames

    megatron = nn.Module()
    megatron.config = types.SimpleNamespace(multi_latent_attention=False)
    other = nn.Module()
    other.config = types.SimpleNamespace(model_type="llama", vocab_size=1000)
    vocab = {spec: adapters.hf_naming(megatron, "megatron", other, "transformers", spec).vocab_size
             for spec in (None, True, "llama", HFNames(vocab_size=999))}
    assert vocab == {None: 1000, True: 1000, "llama": 1000, HFNames(vocab_size=999): 999}
    assert adapters.hf_naming(megatron, "megatron", None, None, {"model_type": "llama", "vocab_size": 7}) == \
        HFNames(vocab_size=7)
    assert adapters.hf_naming(megatron, "megatron", None, None, "llama") == HFNames()  # the model's own


VIEW_CASES = [  # (global shape, mesh shape, placements, ops)
    ((8, 6), (2,), [("S", 0)], [("split_dim", 0, (2, 2, 2))]),
    ((8, 6), (4,), [("S", 0)], [("split_dim", 0, (2, 2, 2))]),  # one mesh dim over two new dims
    ((8, 6), (2, 2), [("S", 0), ("S", 0)], [("split_dim", 0, (2, 4))]),
    ((8, 6), (2, 2), [("R",), ("S", 1)], [("split_dim", 0, (4, 2)), ("transpose", 0, 2)]),
    ((4, 6, 3), (2,), [("S", 0)], [("narrow", 1, 0, 3), ("select", 0, 3)]),  # an expert of a stacked tensor
    ((4, 6, 3), (2,), [("S", 0)], [("narrow", 0, 2, 2)]),  # whole shards
    ((4, 6, 3), (2,), [("S", 1)], [("narrow", 1, 3, 3), ("select", 0, 1)]),  # inside one shard
    ((4, 6, 3), (2,), [("S", 1)], [("narrow", 1, 1, 2)]),
    ((8, 6), (2,), [("S", 0)], [("narrow", 0, 0, 7)]),  # across shards: a padded vocabulary's real rows
    ((12, 2), (2, 4), [("R",), ("S", 0)], [("narrow", 0, 0, 5)]),  # sizes (3, 2, 0, 0): two ranks only padding
    ((6, 4), (2,), [("S", 0)], [("narrow", 0, 2, 2), ("transpose", 0, 1)]),  # straddling: one row on each
]


def _layout(shape: tuple, mesh_shape: tuple, places: list) -> Any:
    import reshard_ext as rx

    n = 1
    for s in mesh_shape:
        n *= s
    return rx.Layout(shape, torch.float32, rx.Mesh(torch.arange(n).reshape(mesh_shape).tolist()),
                     [rx.Replicate() if p[0] == "R" else rx.Shard(p[1]) for p in places])


@pytest.mark.parametrize("case", range(len(VIEW_CASES)))
def test_views_match_the_viewed_global_tensor(case: int) -> None:
    """Each op applied to every rank's piece and to the layout gives that rank's piece of the
    op applied to the global tensor."""
    from reshard_ext import views

    shape, mesh_shape, places, ops = VIEW_CASES[case]
    layout = _layout(shape, mesh_shape, places)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for rank in layout.mesh.ranks:
        piece, lay, whole = layout.local_part(full, rank), layout, full
        for op, *args in ops:
            piece, lay = getattr(views, op)(piece, lay, rank, *args)
            whole = {"split_dim": lambda t, d, s: t.unflatten(d, s), "transpose": torch.transpose,
                     "narrow": torch.narrow, "select": torch.select}[op](whole, *args)
        assert lay.shape == tuple(whole.shape)
        want = lay.local_part(whole.contiguous(), rank)
        assert (piece is None) == (want is None), (rank, lay)
        if piece is not None:
            assert torch.equal(piece, want), (rank, lay)


def test_views_refuse_what_no_layout_can_say() -> None:
    import reshard_ext as rx
    from reshard_ext import views

    lay = _layout((6, 4), (2,), [("S", 0)])
    piece = torch.zeros(3, 4)
    strided = rx.Layout((8, 4), torch.float32, rx.Mesh([0, 1]), [rx.Shard(0, stride=2)])
    with pytest.raises(rx.ReshardError, match="only even plain shards"):
        views.narrow(torch.zeros(4, 4), strided, 0, 0, 0, 3)  # rank 0 holds rows 0, 1, 4, 5
    with pytest.raises(rx.ReshardError, match="boundaries"):
        views.split_dim(piece, lay, 0, 0, (3, 2))  # 3 x 2: two shards of 3 rows cut the first new dim


def _stacked_experts(rank: int, world: int) -> list[str]:
    import transformers

    from reshard_ext.adapters import hf_model

    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=16, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=2, num_local_experts=3))
    got = hf_model.entries(model)  # this rank alone holds it
    want = transformers.core_model_loading.revert_weight_conversion(model, dict(model.state_dict()))
    bad = sorted(set(got) ^ set(want))
    bad += [n for n, (piece, _) in got.items() if n in want and not torch.equal(piece.reshape(want[n].shape), want[n])]
    experts = model.model.layers[0].mlp.experts
    w3, layout = got["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
    if w3.data_ptr() != experts.gate_up_proj[2, 6:].data_ptr() or list(layout.mesh.ranks) != [rank]:
        bad.append("w3 is not a view of gate_up_proj on this rank")
    if got["model.layers.0.self_attn.q_proj.weight"][1].shape != (2, 2, 2, 8):
        bad.append("q_proj is not grouped")
    return bad


def test_transformers_stacked_experts_are_views() -> None:
    """A transformers 5 Mixtral keeps experts stacked ([E, 2I, H] gate_up, [E, H, I] down);
    its per-expert checkpoint tensors are views of those parameters, not copies."""
    pytest.importorskip("transformers")
    assert run_ranks(2, _stacked_experts) == [[], []]


def _fsdp2_source(rank: int, world: int) -> list[str]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import reshard_ext as rx

    config = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4,
                                         moe_intermediate_size=8, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = transformers.AutoModelForCausalLM.from_config(config)
    want = {k: v.clone() for k, v in src.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in src.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(src, mesh=mesh)  # every parameter a DTensor, Shard(0) (stacked experts: over the experts)
    torch.manual_seed(1)
    dst = transformers.AutoModelForCausalLM.from_config(config) if rank == 0 else None
    rx.swap_model_weights(src, dst)
    rx.clear_caches()
    got = dst.state_dict() if dst is not None else want
    return [k for k in want if not torch.equal(want[k], got[k])]


def test_fsdp2_transformers_source_refits_a_whole_model() -> None:
    """An FSDP2-wrapped transformers model (DTensor parameters, stacked experts sharded over
    the expert dim) is described under checkpoint names through its DTensor layouts and
    refits a whole model on rank 0 bit for bit."""
    pytest.importorskip("transformers")
    assert run_ranks(2, _fsdp2_source) == [[], []]


def test_recorder_follows_views_and_names_what_is_not_one() -> None:
    """The ops transformers' reverse conversions use, as view chains of one parameter; a
    concatenation of parameters has none and says why."""
    from reshard_ext.adapters.hf_model import _Recorder

    p = torch.empty(4, 6, 3, device="meta")
    recorder = _Recorder({"w": p})
    with recorder:
        out = {"transpose": torch.transpose(p, dim0=1, dim1=2).contiguous(), "narrow": p.narrow(1, 2, 3),
               "select": torch.select(p, dim=0, index=-1), "split": torch.split(p, [1, 3], dim=0)[1],
               "unbind": p.unbind(2)[1], "chunk_squeeze": p.chunk(4)[2].squeeze(0), "cat": torch.cat([p, p])}
    got = {k: recorder.origin.get(id(t)) for k, t in out.items()}
    assert got == {"transpose": ("w", (("transpose", 1, 2),)), "narrow": ("w", (("narrow", 1, 2, 3),)),
                   "select": ("w", (("narrow", 0, 3, 1), ("squeeze", 0))), "split": ("w", (("narrow", 0, 1, 3),)),
                   "unbind": ("w", (("narrow", 2, 1, 1), ("squeeze", 2))),
                   "chunk_squeeze": ("w", (("narrow", 0, 2, 1), ("squeeze", 0))), "cat": None}
    assert recorder.failed[id(out["cat"])] == "cat of ['w', 'w']"
