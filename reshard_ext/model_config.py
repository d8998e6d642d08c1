"""Model shapes and parallel specs for `python -m reshard_ext simulate`.

A model is a preset name (PRESETS) or a Hugging Face `config.json` (a file or the folder
holding it), turned into a synthetic.ModelShape; a parallel spec is a string such as
"tp=1,pp=16,ep=16", turned into a synthetic.Parallel once the GPU count is known.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import ReshardError
from .synthetic import DEEPSEEK_V3, LLAMA3_8B, LLAMA3_70B, ModelShape, Parallel

LLAMA3_405B = ModelShape(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256)
QWEN3_235B_A22B = ModelShape(
    layers=94, hidden=4096, ffn=12288, heads=64, kv_heads=4, vocab=151936, head_dim=128,
    experts=128, moe_ffn=1536, router_bias=False,
)
KIMI_K2 = ModelShape(
    layers=61, hidden=7168, ffn=18432, heads=64, kv_heads=64, vocab=163840, head_dim=128,
    experts=384, moe_ffn=2048, first_dense_layers=1, shared_expert_ffn=2048,
    q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64,
)


@dataclass(frozen=True)
class Preset:
    shape: ModelShape
    src: str   # default source spec (training)
    dst: str   # default destination spec (inference)
    gpus: int  # default GPUs per side


PRESETS: dict[str, Preset] = {
    "llama-3-8b": Preset(LLAMA3_8B, "tp=2", "tp=1", 8),
    "llama-3-70b": Preset(LLAMA3_70B, "tp=8,pp=2", "tp=4", 64),
    "llama-3-405b": Preset(LLAMA3_405B, "tp=8,pp=16", "tp=16", 256),
    "qwen3-235b-a22b": Preset(QWEN3_235B_A22B, "tp=4,pp=4,ep=8", "tp=8", 64),
    "deepseek-v3": Preset(DEEPSEEK_V3, "tp=1,pp=16,ep=16", "tp=32", 256),
    "kimi-k2": Preset(KIMI_K2, "tp=1,pp=16,ep=16", "tp=32", 256),
}


def preset_key(name: str) -> str | None:
    """The PRESETS key for a name written any common way (Llama-3-8B, llama3_8b, ...)."""
    norm = "".join(ch for ch in name.lower() if ch.isalnum())
    for key in PRESETS:
        if "".join(ch for ch in key if ch.isalnum()) == norm:
            return key
    return None


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _int(cfg: dict, *keys: str, default: int | None = None, low: int = 0) -> int:
    """The first of `keys` present in cfg, as an integer >= low (ReshardError naming it)."""
    value = _get(cfg, *keys, default=default)
    if value is None:
        raise ReshardError(f"config.json has no {keys[0]!r}: not a decoder-only language model config")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        key = next((k for k in keys if cfg.get(k) is not None), keys[0])
        raise ReshardError(f"config.json: {key!r} must be an integer >= {low}, got {value!r}")
    return value


def shape_from_hf_config(cfg: Any) -> ModelShape:
    """A ModelShape from a Hugging Face config: Llama/Qwen/Mistral-style dense models,
    Mixtral/Qwen-MoE-style and DeepSeek-V3/Kimi-K2-style (MLA, shared experts) MoE."""
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal wrappers keep the LM in text_config
    if not isinstance(cfg, dict):
        raise ReshardError(f"config.json must hold a JSON object (a Hugging Face model config), got a "
                           f"{type(cfg).__name__}")
    hidden = _int(cfg, "hidden_size", low=1)
    heads = _int(cfg, "num_attention_heads", low=1)
    layers = _int(cfg, "num_hidden_layers", low=1)
    vocab = _int(cfg, "vocab_size", low=1)
    ffn = _int(cfg, "intermediate_size", "ffn_dim", default=4 * hidden, low=1)
    experts = _int(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0)
    moe_ffn = _int(cfg, "moe_intermediate_size", default=ffn, low=1) if experts else 0
    shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    if not shared and _get(cfg, "n_shared_experts"):
        shared = _int(cfg, "n_shared_experts") * moe_ffn
    first_dense = _int(cfg, "first_k_dense_replace", default=0)
    mla = _get(cfg, "kv_lora_rank") is not None
    if mla and _get(cfg, "q_lora_rank") is None:
        raise ReshardError("config.json: multi-head latent attention without q_lora_rank is not modelled")
    return ModelShape(
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", default=heads, low=1),
        vocab=vocab,
        head_dim=_int(cfg, "qk_nope_head_dim", "head_dim", default=0) or None,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        experts=experts,
        moe_ffn=moe_ffn,
        first_dense_layers=first_dense,
        shared_expert_ffn=shared,
        q_lora_rank=_int(cfg, "q_lora_rank") if mla else 0,
        kv_lora_rank=_int(cfg, "kv_lora_rank") if mla else 0,
        rope_head_dim=_int(cfg, "qk_rope_head_dim", default=0) if mla else 0,
        router_bias=_get(cfg, "topk_method") == "noaux_tc",
    )


def load_model(spec: str) -> tuple[str, ModelShape, Preset | None]:
    """(label, shape, preset or None) for a preset name or a config.json path."""
    key = preset_key(spec)
    if key is not None and not os.path.exists(spec):
        return key, PRESETS[key].shape, PRESETS[key]
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ReshardError(f"model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ReshardError(f"{path}: not valid JSON ({e})") from None
    return path, shape_from_hf_config(cfg), None


_SPEC_KEYS = ("tp", "pp", "dp", "ep")


def parse_spec(text: str) -> dict[str, int]:
    """"tp=1,pp=16,ep=16" -> {"tp": 1, "pp": 16, "ep": 16}."""
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.replace(" ", "").split(","))):
        key, eq, value = item.partition("=")
        key = key.lower()
        if not eq or key not in _SPEC_KEYS or not value.isdigit() or int(value) < 1:
            raise ReshardError(f"parallel spec {text!r}: expected comma-separated tp=N, pp=N, dp=N, ep=N (N >= 1), "
                               f"got {item!r}")
        if key in out:
            raise ReshardError(f"parallel spec {text!r}: {key} given twice")
        out[key] = int(value)
    return out


def make_parallel(spec: dict[str, int], shape: ModelShape, gpus: int, offset: int, side: str) -> Parallel:
    """A Parallel from a parsed spec: dp defaults to gpus / (tp * pp); for MoE models ep
    defaults to tp (each model replica spreads its experts over its own TP ranks)."""
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    if "dp" in spec:
        dp = spec["dp"]
    elif gpus % (tp * pp):
        raise ReshardError(f"{side} spec: tp*pp = {tp * pp} does not divide {gpus} GPUs (give dp= or another --gpus)")
    else:
        dp = gpus // (tp * pp)
    ep = spec.get("ep", tp if shape.experts else 1)
    if pp > shape.layers:
        raise ReshardError(f"{side} spec: pp={pp} exceeds the model's {shape.layers} layers")
    if shape.experts:
        if shape.experts % ep:
            raise ReshardError(f"{side} spec: ep={ep} does not divide the {shape.experts} experts")
        if (tp * dp) % ep:
            raise ReshardError(f"{side} spec: ep={ep} does not divide the tp*dp = {tp * dp} ranks of a pipeline stage")
    elif ep != 1:
        raise ReshardError(f"{side} spec: ep={ep} for a dense model")
    return Parallel(tp=tp, pp=pp, dp=dp, ep=ep, offset=offset)


def describe_parallel(par: Parallel, moe: bool) -> str:
    parts = [f"TP{par.tp}"] + ([f"PP{par.pp}"] if par.pp > 1 else []) + [f"DP{par.dp}"]
    if moe:
        parts.append(f"EP{par.ep}")
    return "·".join(parts) + f" ({par.world} GPUs from rank {par.offset})"
