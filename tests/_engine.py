"""A small inference engine with vLLM's parameter conventions, for the tracing tests.

Written for these tests from vLLM's documented behaviour (its layers' docstrings and the
loading rules of its Llama and Qwen3-MoE models), not copied:
- ``qkv_proj``: q, k, v rows of this TP rank concatenated; with fewer KV heads than TP
  ranks each KV head is replicated on tp/kv consecutive ranks (rank r holds KV head
  r // (tp/kv)).
- ``gate_up_proj`` (merged column parallel): [gate rows of rank r; up rows of rank r].
- ``o_proj``/``down_proj`` (row parallel): input columns split over TP.
- ``embed_tokens``/``lm_head`` (vocab parallel): the vocabulary padded to a multiple of 64,
  split in equal partitions; rank r loads rows [r*P, min((r+1)*P, V)) and zero-fills the
  rest of its partition. Tied embeddings: lm_head is the embedding module, and the loader
  skips ``lm_head.weight``.
- MoE: ``experts.w13_weight`` [E_local, 2*I/tp, H] (gate half then up half of this TP
  rank) and ``experts.w2_weight`` [E_local, H, I/tp]; with expert parallelism the experts
  are split over the ranks in order (E/ep each) and not TP-sharded; a rank skips experts it
  does not hold.
- ``load_weights``: the stacked-parameter mapping (q/k/v -> qkv_proj, gate/up ->
  gate_up_proj), the expert mapping (experts.{e}.{gate,up,down}_proj -> w13/w2 with the
  expert id), each parameter's ``weight_loader``, and a default loader (copy) for the rest.

``odd`` makes one loader step fall outside the traced set, for the safe-path tests.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

ODD = ("scale", "item", "temp", "permute", "cat", "half", "plus-one", "readback", "raises", "replace")


@dataclass(frozen=True)
class Config:
    vocab: int = 1000
    hidden: int = 32
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 4
    inter: int = 48
    tie: bool = False
    qkv_bias: bool = False
    experts: int = 0          # > 0: every layer's MLP is a MoE of this many experts
    moe_inter: int = 16
    ep: bool = False          # experts split over the ranks instead of TP-sharded
    fused: bool = False       # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3 style)
    dtype: torch.dtype = torch.float32
    odd: str = ""             # one loader step outside the traced set (ODD)


def _divide(a: int, b: int) -> int:
    assert a % b == 0, (a, b)
    return a // b


def _default_loader(param: torch.Tensor, w: torch.Tensor) -> None:
    assert param.shape == w.shape, (param.shape, w.shape)
    param.data.copy_(w)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, tp: int, dtype: torch.dtype):
        super().__init__()
        padded = -(-vocab // 64) * 64
        per = _divide(padded, tp)
        self.vocab, self.start, self.end = vocab, min(rank * per, vocab), min((rank + 1) * per, vocab)
        self.weight = nn.Parameter(torch.empty(per, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor) -> None:
        assert w.shape[0] == self.vocab
        w = w.narrow(0, self.start, self.end - self.start)
        param[: w.shape[0]].data.copy_(w)
        param[w.shape[0]:].data.fill_(0)


class MergedColumnParallelLinear(nn.Module):
    """Column parallel with several logical outputs (gate/up), each split over TP."""

    def __init__(self, inp: int, outputs: list[int], rank: int, tp: int, dtype: torch.dtype, odd: str = ""):
        super().__init__()
        self.outputs, self.rank, self.tp, self.odd = outputs, rank, tp, odd
        self.weight = nn.Parameter(torch.empty(sum(outputs) // tp, inp, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: int | None = None) -> None:
        if shard is None:  # fused on disk: split into the logical outputs
            offset = 0
            for i, size in enumerate(self.outputs):
                self.weight_loader(param, w.narrow(0, offset, size), i)
                offset += size
            return
        size = self.outputs[shard] // self.tp
        offset = sum(self.outputs[:shard]) // self.tp
        param.data.narrow(0, offset, size).copy_(w.narrow(0, self.rank * size, size))


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, rank: int, tp: int,
                 dtype: torch.dtype, bias: bool, odd: str = ""):
        super().__init__()
        self.head_dim, self.rank, self.odd, self.total_heads = head_dim, rank, odd, heads
        self.heads = _divide(heads, tp)
        if tp >= kv_heads:
            self.kv_heads, self.replicas = 1, _divide(tp, kv_heads)
        else:
            self.kv_heads, self.replicas = _divide(kv_heads, tp), 1
        rows = (self.heads + 2 * self.kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard: str | None = None) -> None:
        d = self.head_dim
        if shard is None:  # fused on disk: [q; k; v] of all heads
            kv = (w.shape[0] // d - self.total_heads) // 2
            for name, start, size in (("q", 0, self.total_heads), ("k", self.total_heads, kv),
                                      ("v", self.total_heads + kv, kv)):
                self.weight_loader(param, w.narrow(0, start * d, size * d), name)
            return
        if shard == "q":
            offset, size, owner = 0, self.heads * d, self.rank
            if self.odd == "permute" and w.dim() == 2:  # rotary halves interleaved, as for Mistral-format files
                h = w.shape[1]
                w = w.view(self.total_heads, 2, d // 2, h).transpose(1, 2).reshape(self.total_heads * d, h)
        else:
            offset = (self.heads if shard == "k" else self.heads + self.kv_heads) * d
            size, owner = self.kv_heads * d, self.rank // self.replicas
        param.data.narrow(0, offset, size).copy_(w.narrow(0, owner * size, size))


class RowParallelLinear(nn.Module):
    def __init__(self, inp: int, out: int, rank: int, tp: int, dtype: torch.dtype, odd: str = ""):
        super().__init__()
        self.rank, self.odd = rank, odd
        self.weight = nn.Parameter(torch.empty(out, inp // tp, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor) -> None:
        size = param.shape[1]
        w = w.narrow(1, self.rank * size, size)
        if self.odd == "item" and w.abs().max().item() > 1e30:  # a sanity check that reads values
            raise ValueError("weight out of range")
        if self.odd == "temp":  # through a temporary buffer
            buf = torch.empty_like(param.data)
            buf.copy_(w)
            param.data.copy_(buf)
            return
        param.data.copy_(w)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, odd: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        loaders = {
            "scale": lambda p, w: p.data.copy_(w * 1.0),
            "half": lambda p, w: p.data.copy_(w.to(torch.float16)),  # a lossy cast on the way
            "plus-one": lambda p, w: p.data.copy_(w).add_(1.0),  # stored as 1 + w, as some norms are
        }
        if odd in loaders:
            self.weight.weight_loader = loaders[odd]  # type: ignore[attr-defined]


class FusedMoE(nn.Module):
    def __init__(self, cfg: Config, rank: int, tp: int):
        super().__init__()
        ep = tp if cfg.ep else 1
        moe_tp, moe_rank = (1, 0) if cfg.ep else (tp, rank)
        local = _divide(cfg.experts, ep)
        self.first = (rank if cfg.ep else 0) * local
        self.local, self.moe_rank = local, moe_rank
        inter = _divide(cfg.moe_inter, moe_tp)
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * inter, cfg.hidden, dtype=cfg.dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, cfg.hidden, inter, dtype=cfg.dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, name: str, shard: str, expert: int) -> None:
        e = expert - self.first
        if not 0 <= e < self.local:
            return  # another rank's expert
        data = param.data[e]
        if shard in ("w1", "w3"):
            size = data.shape[0] // 2
            w = w.narrow(0, self.moe_rank * size, size)
            data.narrow(0, 0 if shard == "w1" else size, size).copy_(w)
        else:
            size = data.shape[1]
            data.copy_(w.narrow(1, self.moe_rank * size, size))


class Layer(nn.Module):
    def __init__(self, cfg: Config, rank: int, tp: int):
        super().__init__()
        odd = cfg.odd
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, rank, tp,
                                                    cfg.dtype, cfg.qkv_bias, odd)
        self.self_attn.o_proj = RowParallelLinear(cfg.heads * cfg.head_dim, cfg.hidden, rank, tp, cfg.dtype, odd)
        self.mlp = nn.Module()
        if cfg.experts:
            self.mlp.gate = nn.Module()
            self.mlp.gate.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, dtype=cfg.dtype),
                                                requires_grad=False)
            self.mlp.experts = FusedMoE(cfg, rank, tp)
        else:
            self.mlp.gate_up_proj = MergedColumnParallelLinear(cfg.hidden, [cfg.inter, cfg.inter], rank, tp,
                                                               cfg.dtype, odd)
            self.mlp.down_proj = RowParallelLinear(cfg.inter, cfg.hidden, rank, tp, cfg.dtype,
                                                   "temp" if odd == "temp" else "")
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.dtype, odd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.dtype)
        if odd == "readback":  # one norm loaded, then copied on into the other (read back from the parameter)
            def both(p: nn.Parameter, w: torch.Tensor) -> None:
                p.data.copy_(w)
                self.input_layernorm.weight.data.copy_(p.data)

            self.post_attention_layernorm.weight.weight_loader = both  # type: ignore[attr-defined]


class Engine(nn.Module):
    """One TP rank of the engine (rank `rank` of `tp`)."""

    def __init__(self, cfg: Config, rank: int = 0, tp: int = 1):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab, cfg.hidden, rank, tp, cfg.dtype)
        self.model.layers = nn.ModuleList(Layer(cfg, rank, tp) for _ in range(cfg.layers))
        self.model.norm = RMSNorm(cfg.hidden, cfg.dtype)
        self.lm_head = self.model.embed_tokens if cfg.tie else \
            VocabParallelEmbedding(cfg.vocab, cfg.hidden, rank, tp, cfg.dtype)
        with torch.no_grad():  # stale values everywhere: a refit must write every element it owns
            for p in self.parameters():
                p.fill_(float("nan") if p.dtype.is_floating_point else 7)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Fused checkpoint names first: "qkv_proj" contains "v_proj", "gate_up_proj" "up_proj".
        fused: list[tuple[str, str, str | int | None]] = [("qkv_proj", "qkv_proj", None),
                                                          ("gate_up_proj", "gate_up_proj", None)]
        stacked = (fused if self.cfg.fused else []) + [
            ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
        experts = [(f"experts.{'w2' if proj == 'down_proj' else 'w13'}_weight", f"experts.{e}.{proj}.weight", e, shard)
                   for e in range(self.cfg.experts)
                   for proj, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))]
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending_k: dict[str, torch.Tensor] = {}
        for name, w in weights:
            if "rotary_emb.inv_freq" in name or (self.cfg.tie and name == "lm_head.weight"):
                continue
            if self.cfg.odd == "raises" and name.endswith("post_attention_layernorm.weight"):
                raise KeyError(f"no parameter for {name}")
            if self.cfg.odd == "replace" and name == "model.norm.weight":
                self.model.norm.weight = nn.Parameter(w.new_zeros(w.shape) if not w.is_meta else w,
                                                      requires_grad=False)
                continue
            if self.cfg.odd == "cat" and name.endswith("k_proj.weight"):
                pending_k[name] = w  # held back: fused with v below, then split again
                continue
            for param_name, weight_name, shard in stacked:
                if weight_name not in name or "mlp.experts" in name:
                    continue
                target = name.replace(weight_name, param_name)
                if self.cfg.odd == "cat" and weight_name == "v_proj" and name.endswith(".weight"):
                    k_name = name.replace("v_proj", "k_proj")
                    k, v = torch.cat([pending_k.pop(k_name), w]).chunk(2)
                    params[target].weight_loader(params[target], k, "k")
                    params[target].weight_loader(params[target], v, "v")
                    loaded.add(k_name)
                    break
                params[target].weight_loader(params[target], w, shard)
                break
            else:
                for param_name, weight_name, expert, shard in experts:
                    if not name.endswith(weight_name):
                        continue
                    target = name.replace(weight_name, param_name)
                    params[target].weight_loader(params[target], w, target, shard, expert)
                    break
                else:
                    p = params[name]
                    getattr(p, "weight_loader", _default_loader)(p, w)
            loaded.add(name)
        return loaded


def hf_weights(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint of `cfg` (random values), in checkpoint order."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*shape, generator=g).to(cfg.dtype) for n, shape in hf_shapes(cfg).items()}


def hf_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face checkpoint of `cfg` and their shapes, in checkpoint order."""

    def rand(*shape: int) -> tuple[int, ...]:
        return shape

    h, d = cfg.hidden, cfg.head_dim
    out = {"model.embed_tokens.weight": rand(cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        if cfg.fused:
            out[p + "self_attn.qkv_proj.weight"] = rand((cfg.heads + 2 * cfg.kv_heads) * d, h)
        else:
            out[p + "self_attn.q_proj.weight"] = rand(cfg.heads * d, h)
            out[p + "self_attn.k_proj.weight"] = rand(cfg.kv_heads * d, h)
            out[p + "self_attn.v_proj.weight"] = rand(cfg.kv_heads * d, h)
        if cfg.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = rand(cfg.heads * d)
            out[p + "self_attn.k_proj.bias"] = rand(cfg.kv_heads * d)
            out[p + "self_attn.v_proj.bias"] = rand(cfg.kv_heads * d)
        out[p + "self_attn.o_proj.weight"] = rand(h, cfg.heads * d)
        if cfg.experts:
            out[p + "mlp.gate.weight"] = rand(cfg.experts, h)
            for e in range(cfg.experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(cfg.moe_inter, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = rand(cfg.moe_inter, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = rand(h, cfg.moe_inter)
        else:
            if cfg.fused:
                out[p + "mlp.gate_up_proj.weight"] = rand(2 * cfg.inter, h)
            else:
                out[p + "mlp.gate_proj.weight"] = rand(cfg.inter, h)
                out[p + "mlp.up_proj.weight"] = rand(cfg.inter, h)
            out[p + "mlp.down_proj.weight"] = rand(h, cfg.inter)
        out[p + "input_layernorm.weight"] = rand(h)
        out[p + "post_attention_layernorm.weight"] = rand(h)
    out["model.norm.weight"] = rand(h)
    if not cfg.tie:
        out["lm_head.weight"] = rand(cfg.vocab, h)
    return out
