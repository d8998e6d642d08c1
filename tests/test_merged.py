"""Merged targets, bit for bit against concatenating / stacking the logical source tensors."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_ranks

G, HPG, D, H, I, E = 2, 2, 2, 4, 4, 4  # kv groups, q heads per group, head dim, hidden, ffn, experts


def _logical(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"q": r(G, HPG, D, H), "k": r(G, D, H), "v": r(G, D, H), "gate": r(I, H), "up": r(I, H)}
    for e in range(E):
        t[f"fc1.weight{e}"] = r(2 * I, H)  # Megatron fused [gate; up]
        t[f"fc2.weight{e}"] = r(H, I)
    return t


def _qkv(rank: int, world: int, dst_tp: int) -> Any:
    import reshard_ext as rx
    from reshard_ext import merged

    t = _logical()
    # Source: Megatron's fused QKV, per group [q heads; k; v], groups over TP2 x DP2.
    fused = torch.cat([torch.cat([t["q"][i], t["k"][i : i + 1], t["v"][i : i + 1]]) for i in range(G)]).reshape(-1, H)
    src_layout = rx.Layout(fused.shape, fused.dtype, rx.Mesh([[0, 1], [2, 3]]), [rx.Replicate(), rx.Shard(0)])
    src = merged.split_interleaved_qkv({"qkv": (src_layout.local_part(fused, rank), src_layout)}, "qkv",
                                       ("q", "k", "v"), num_query_groups=G, head_dim=D)
    # Destination: vLLM's [q_r; k_r; v_r] over the first dst_tp ranks.
    dst, local, want = {}, None, None
    if rank < dst_tp:
        rep = max(dst_tp // G, 1)
        heads = G * HPG // dst_tp
        q_r = t["q"].flatten(0, 1)[rank * heads:(rank + 1) * heads]
        kv = slice(rank // rep, rank // rep + 1) if dst_tp > G else slice(rank * G // dst_tp, (rank + 1) * G // dst_tp)
        want = torch.cat([q_r.flatten(0, 1), t["k"][kv].flatten(0, 1), t["v"][kv].flatten(0, 1)])
        local = torch.zeros_like(want)
        parts = merged.qkv_layouts(("q", "k", "v"), num_query_groups=G, heads_per_group=HPG, head_dim=D,
                                   hidden=H, dtype=torch.float32, tp_ranks=list(range(dst_tp)))
        dst = merged.concat(local, 0, parts, rank)
    rx.execute(rx.plan(src=src, dst=dst))
    return want is None or torch.equal(local, want)


@pytest.mark.parametrize("dst_tp", [1, 2, 4])
def test_qkv_from_megatron_interleaved_to_vllm(dst_tp: int) -> None:
    assert all(run_ranks(4, _qkv, dst_tp))


def _gate_up_and_experts(rank: int, world: int) -> Any:
    import reshard_ext as rx
    from reshard_ext import merged

    t = _logical()
    tp = rx.Mesh([[0, 1, 2, 3]])
    src = {}
    for name in ("gate", "up"):  # separate tensors, Shard(0) over TP2 x DP2
        lay = rx.Layout(t[name].shape, torch.float32, rx.Mesh([[0, 1], [2, 3]]), [rx.Replicate(), rx.Shard(0)])
        src[name] = (lay.local_part(t[name], rank), lay)
    ep = rank // 2  # experts over EP2 (ranks 0,1 hold experts 0,1), replicated over 2 ranks
    for e in range(ep * 2, ep * 2 + 2):
        mesh = rx.Mesh([[ep * 2], [ep * 2 + 1]])
        for name, place in ((f"fc1.weight{e}", rx.Shard(0, stride=2)), (f"fc2.weight{e}", rx.Shard(1))):
            lay = rx.Layout(t[name].shape, torch.float32, mesh, [rx.Replicate(), place])
            src[name] = (lay.local_part(t[name], rank), lay)
    # Destination: vLLM gate_up [gate_r; up_r], w13 [E, 2I/4, H] and w2 [E, H, I/4] over TP4.
    gate_up = torch.zeros(2 * I // 4, H)
    w13, w2 = torch.zeros(E, 2 * I // 4, H), torch.zeros(E, H, I // 4)
    lay = lambda shape, p: rx.Layout(shape, torch.float32, tp, [rx.Replicate(), p])  # noqa: E731
    dst = merged.concat(gate_up, 0, [("gate", lay((I, H), rx.Shard(0))), ("up", lay((I, H), rx.Shard(0)))], rank)
    dst |= merged.stack(w13, 0, [(f"fc1.weight{e}", lay((2 * I, H), rx.Shard(0, stride=2))) for e in range(E)], rank)
    dst |= merged.stack(w2, 0, [(f"fc2.weight{e}", lay((H, I), rx.Shard(1))) for e in range(E)], rank)
    rx.execute(rx.plan(src=src, dst=dst))
    c = lambda x: x.chunk(4, 0)[rank]  # noqa: E731
    ok = torch.equal(gate_up, torch.cat([c(t["gate"]), c(t["up"])]))
    for e in range(E):
        gate, up = t[f"fc1.weight{e}"].chunk(2)
        ok &= torch.equal(w13[e], torch.cat([c(gate), c(up)]))
        ok &= torch.equal(w2[e], t[f"fc2.weight{e}"].chunk(4, 1)[rank])
    return ok


def test_gate_up_and_stacked_experts() -> None:
    assert all(run_ranks(4, _gate_up_and_experts))


def test_concat_rejects_incomplete_cover() -> None:
    import reshard_ext as rx
    from reshard_ext import merged

    lay = rx.Layout((4, 2), torch.float32, rx.Mesh([0]), [rx.Replicate()])
    with pytest.raises(rx.ReshardError):
        merged.concat(torch.zeros(6, 2), 0, [("a", lay)], 0)
