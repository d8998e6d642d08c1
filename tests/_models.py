"""Tiny Megatron-like models for CPU tests: layers carry exactly Megatron-Core's parameter
attributes and module conventions, and compute with torch.distributed (gloo), so two
differently-parallel instances of the same logical model give the same logits.

Each parameter also records its logical origin (`_origin`: global name, global shape,
partition dim, stride, tp size, tp rank), written independently of reshard_ext, so tests
can check refitted pieces against a deterministic global tensor.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    vocab: int = 16
    hidden: int = 8
    ffn: int = 8
    layers: int = 2
    num_moe_experts: int | None = None
    moe_ffn: int = 4
    tied: bool = False
    bias_dtype: torch.dtype = torch.float32  # router expert_bias buffer


@dataclass
class PGCollection:  # Megatron's ProcessGroupCollection fields used here, plus test-only ones
    tp: Any
    dp: Any
    pp: Any
    ep: Any
    expt_tp: Any
    expt_dp: Any
    tp_ep: Any  # test forward only: the ranks that together hold all experts of a replica
    stage: int
    pp_ranks: list


def make_groups(world: int, base: int, tp: int, pp: int, dp: int, ep: int = 1,
                etp: int | None = None) -> PGCollection | None:
    """Creates (on every rank of the world, in the same order) the groups of a model on
    ranks base .. base+tp*dp*pp-1 in Megatron order (tp fastest, then dp, then pp; experts:
    etp, ep, edp). Returns this rank's groups, None if it is not in the model."""
    etp = etp or tp
    n = tp * dp
    assert n % (etp * ep) == 0
    edp = n // (etp * ep)
    me = dist.get_rank()
    mine: dict[str, Any] = {}

    def new(kind: str, ranks: list[int]) -> None:
        g = dist.new_group(ranks)
        if me in ranks:
            mine[kind] = g
            if kind == "pp":
                mine["pp_ranks"] = ranks

    R = lambda p, s: base + p * n + s  # noqa: E731
    for p in range(pp):
        for d in range(dp):
            new("tp", [R(p, d * tp + j) for j in range(tp)])
        for j in range(tp):
            new("dp", [R(p, d * tp + j) for d in range(dp)])
        S = lambda a, e, f: a + etp * (e + ep * f)  # noqa: E731
        for e in range(ep):
            for f in range(edp):
                new("expt_tp", [R(p, S(a, e, f)) for a in range(etp)])
        for a in range(etp):
            for f in range(edp):
                new("ep", [R(p, S(a, e, f)) for e in range(ep)])
            for e in range(ep):
                new("expt_dp", [R(p, S(a, e, f)) for f in range(edp)])
        for f in range(edp):
            new("tp_ep", [R(p, S(a, e, f)) for e in range(ep) for a in range(etp)])
    for s in range(n):
        new("pp", [R(p, s) for p in range(pp)])
    if not (base <= me < base + n * pp):
        return None
    return PGCollection(stage=(me - base) // n, **mine)


def _param(local_shape, origin, **attrs) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(local_shape), requires_grad=False)
    p._origin = origin
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _tp(pg: PGCollection, expert: bool = False) -> tuple[int, int, Any]:
    g = pg.expt_tp if expert else pg.tp
    return dist.get_world_size(g), dist.get_rank(g), g


class ColumnParallelLinear(nn.Module):
    def __init__(self, gname: str, in_f: int, out_f: int, pg: PGCollection, stride: int = 1,
                 gather_output: bool = False, bias: bool = True):
        super().__init__()
        P, r, self.group = _tp(pg)
        self.gather_output = gather_output
        self.weight = _param((out_f // P, in_f), (gname + ".weight", (out_f, in_f), 0, stride, P, r),
                             tensor_model_parallel=True, partition_dim=0, partition_stride=stride)
        self.bias = _param((out_f // P,), (gname + ".bias", (out_f,), 0, stride, P, r),
                           tensor_model_parallel=True, partition_dim=0, partition_stride=stride) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight if weight is None else weight, self.bias)
        if self.gather_output and dist.get_world_size(self.group) > 1:
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, y.contiguous(), group=self.group)
            y = torch.cat(parts, dim=-1)
        return y


class RowParallelLinear(nn.Module):
    def __init__(self, gname: str, in_f: int, out_f: int, pg: PGCollection):
        super().__init__()
        P, r, self.group = _tp(pg)
        self.weight = _param((out_f, in_f // P), (gname + ".weight", (out_f, in_f), 1, 1, P, r),
                             tensor_model_parallel=True, partition_dim=1, partition_stride=1)
        self.bias = _param((out_f,), (gname + ".bias", (out_f,), 0, 1, 1, 0))  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        dist.all_reduce(y, group=self.group)
        return y + self.bias


class Norm(nn.Module):
    def __init__(self, gname: str, hidden: int):
        super().__init__()
        self.weight = _param((hidden,), (gname + ".weight", (hidden,), 0, 1, 1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + self.weight)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, gname: str, vocab: int, hidden: int, pg: PGCollection):
        super().__init__()
        P, r, self.group = _tp(pg)
        self.start, self.rows = r * vocab // P, vocab // P
        self.weight = _param((vocab // P, hidden), (gname, (vocab, hidden), 0, 1, P, r),
                             tensor_model_parallel=True, partition_dim=0, partition_stride=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mask = (local >= 0) & (local < self.rows)
        y = F.embedding(local.clamp(0, self.rows - 1), self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y, group=self.group)
        return y


class GroupedLinear(nn.Module):
    """TEGroupedLinear-like: one weightK per local expert, allreduce=False."""

    def __init__(self, gname: str, experts: list[int], in_f: int, out_f: int, dim: int, stride: int, pg: PGCollection):
        super().__init__()
        P, r, _ = _tp(pg, expert=True)
        shape = (out_f // P, in_f) if dim == 0 else (out_f, in_f // P)
        for k, e in enumerate(experts):
            self.register_parameter(f"weight{k}", _param(shape,
                                                         (f"{gname}.weight{e}", (out_f, in_f), dim, stride, P, r),
                                                         tensor_model_parallel=True, partition_dim=dim,
                                                         partition_stride=stride, allreduce=False))


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)  # local [gate_r; up_r] (partition_stride 2)
    return F.silu(gate) * up


class MoE(nn.Module):
    def __init__(self, prefix: str, cfg: Config, pg: PGCollection):
        super().__init__()
        E = cfg.num_moe_experts
        ep, er = dist.get_world_size(pg.ep), dist.get_rank(pg.ep)
        self.experts_here = list(range(er * E // ep, (er + 1) * E // ep))
        self.group = pg.tp_ep
        self.router = nn.Module()
        self.router.weight = _param((E, cfg.hidden), (prefix + ".router.weight", (E, cfg.hidden), 0, 1, 1, 0))
        self.router.register_buffer("expert_bias", torch.zeros(E, dtype=cfg.bias_dtype))
        self.router.expert_bias._origin = (prefix + ".router.expert_bias", (E,), 0, 1, 1, 0)
        self.router.register_buffer("local_tokens_per_expert", torch.zeros(E), persistent=False)
        self.experts = nn.Module()
        self.experts.linear_fc1 = GroupedLinear(prefix + ".experts.linear_fc1", self.experts_here,
                                                cfg.hidden, 2 * cfg.moe_ffn, 0, 2, pg)
        self.experts.linear_fc2 = GroupedLinear(prefix + ".experts.linear_fc2", self.experts_here,
                                                cfg.moe_ffn, cfg.hidden, 1, 1, pg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(x @ self.router.weight.t() + self.router.expert_bias.float(), dim=-1)
        out = torch.zeros_like(x)
        for k, e in enumerate(self.experts_here):
            h = _swiglu(x @ getattr(self.experts.linear_fc1, f"weight{k}").t())
            out += probs[:, e:e + 1] * (h @ getattr(self.experts.linear_fc2, f"weight{k}").t())
        dist.all_reduce(out, group=self.group)
        return out


class MLP(nn.Module):
    def __init__(self, prefix: str, cfg: Config, pg: PGCollection):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(prefix + ".linear_fc1", cfg.hidden, 2 * cfg.ffn, pg, stride=2)
        self.linear_fc2 = RowParallelLinear(prefix + ".linear_fc2", cfg.ffn, cfg.hidden, pg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(_swiglu(self.linear_fc1(x)))


class Attention(nn.Module):  # a stand-in with attention's parameter names and parallelism
    def __init__(self, prefix: str, cfg: Config, pg: PGCollection):
        super().__init__()
        self.linear_qkv = ColumnParallelLinear(prefix + ".linear_qkv", cfg.hidden, 3 * cfg.hidden, pg)
        self.linear_proj = RowParallelLinear(prefix + ".linear_proj", 3 * cfg.hidden, cfg.hidden, pg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_proj(torch.tanh(self.linear_qkv(x)))


class TransformerLayer(nn.Module):
    def __init__(self, layer_number: int, cfg: Config, pg: PGCollection):
        super().__init__()
        self.layer_number = layer_number  # 1-based, global (as Megatron-Core)
        prefix = f"decoder.layers.{layer_number - 1}"
        self.input_layernorm = Norm(prefix + ".input_layernorm", cfg.hidden)
        self.self_attention = Attention(prefix + ".self_attention", cfg, pg)
        self.pre_mlp_layernorm = Norm(prefix + ".pre_mlp_layernorm", cfg.hidden)
        self.mlp = MoE(prefix + ".mlp", cfg, pg) if cfg.num_moe_experts else MLP(prefix + ".mlp", cfg, pg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config, pg: PGCollection, layer_ids: list[int] | None = None):
        super().__init__()
        self.config, self.pg_collection = cfg, pg
        pp = len(pg.pp_ranks)
        first, last = pg.stage == 0, pg.stage == pp - 1
        self.share_embeddings_and_output_weights = cfg.tied
        if layer_ids is None:
            per = cfg.layers // pp
            layer_ids = list(range(pg.stage * per, (pg.stage + 1) * per))
        if first:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding("embedding.word_embeddings.weight",
                                                                    cfg.vocab, cfg.hidden, pg)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(TransformerLayer(i + 1, cfg, pg) for i in layer_ids)
        if last:
            self.decoder.final_layernorm = Norm("decoder.final_layernorm", cfg.hidden)
            self.output_layer = ColumnParallelLinear("output_layer", cfg.hidden, cfg.vocab, pg,
                                                     gather_output=True, bias=False)
            if cfg.tied and first:  # Megatron: the output layer reads the word embeddings
                del self.output_layer.weight
                self.output_layer.weight = None
            elif cfg.tied:  # its own copy on the last stage, equal to the embeddings
                self.output_layer.weight._origin = (("embedding.word_embeddings.weight",)
                                                    + self.output_layer.weight._origin[1:])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cfg, pg = self.config, self.pg_collection
        pp = len(pg.pp_ranks)
        h = torch.zeros(ids.shape[0], cfg.hidden)
        for stage in range(pp):
            if stage == pg.stage:
                if stage == 0:
                    h = self.embedding.word_embeddings(ids)
                for layer in self.decoder.layers:
                    h = layer(h)
            if pp > 1 and stage < pp - 1:
                dist.broadcast(h, src=pg.pp_ranks[stage], group=pg.pp)
        logits = torch.zeros(ids.shape[0], cfg.vocab)
        if pg.stage == pp - 1:
            w = (self.output_layer.weight if self.output_layer.weight is not None
                 else self.embedding.word_embeddings.weight)
            logits = self.output_layer(self.decoder.final_layernorm(h), weight=w)
        if pp > 1:
            dist.broadcast(logits, src=pg.pp_ranks[-1], group=pg.pp)
        return logits


def global_tensor(name: str, shape: tuple, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("expert_bias"):  # multiples of 1/8: exact in bf16 too
        return (torch.randint(-8, 8, shape, generator=g).float() / 8).to(dtype)
    return (torch.randn(shape, generator=g) * 0.5).to(dtype)


def expected_local(origin: tuple, seed: int, dtype: torch.dtype) -> torch.Tensor:
    name, shape, dim, stride, P, r = origin
    full = global_tensor(name, shape, seed, dtype)
    chunks = full.chunk(P * stride, dim)
    return torch.cat([chunks[r + k * P] for k in range(stride)], dim)


def tensors_with_origin(model: nn.Module):
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if hasattr(t, "_origin"):
            yield name, t


def fill(model: nn.Module, seed: int) -> None:
    with torch.no_grad():
        for _, t in tensors_with_origin(model):
            t.copy_(expected_local(t._origin, seed, t.dtype))


def check_filled(model: nn.Module, seed: int) -> list[str]:
    """Names of tensors that differ (bit for bit) from the seed's logical weights."""
    return [n for n, t in tensors_with_origin(model) if not torch.equal(t, expected_local(t._origin, seed, t.dtype))]
