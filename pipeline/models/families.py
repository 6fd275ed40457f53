"""The model families of the fast path: what each changes in the Llama decoder, and how to read it from a config.

A `Family` lists only what differs from Llama; `llama.LlamaArgs.from_hf` reads every config through its family's
entry in `FAMILIES`, and `family_reason` says why a config of a known family cannot run exactly.

| model_type  | differs from Llama                                                                               |
|-------------|--------------------------------------------------------------------------------------------------|
| llama       | nothing (`llama3` RoPE scaling included)                                                         |
| mistral     | one sliding window on every layer                                                                |
| qwen2       | q/k/v biases                                                                                     |
| qwen3       | RMSNorm over each query and key head before RoPE                                                 |
| gemma2      | (1 + weight) RMSNorm, norms after attention and MLP too, GeGLU (tanh), embeddings x sqrt(hidden),|
|             | query_pre_attn_scalar, attention and final logit soft-capping, sliding and global layers         |
| gemma3_text | as gemma2, plus q/k norm; sliding layers have their own RoPE base; no attention soft-capping     |
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal

import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    """What a model family changes in the Llama decoder layer; every default is Llama's."""

    unit_offset_norm: bool = False  # RMSNorm scales by (1 + weight) in float32, then casts (Gemma); else weight * cast
    qk_norm: bool = False  # RMSNorm over each query and key head, before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before each joins the residual
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size), rounded to the model dtype (Gemma)
    qkv_bias_default: bool = False  # q/k/v biases whatever `attention_bias` says (Qwen2)
    activation_key: str = "hidden_act"  # the config key naming the MLP gate's activation
    # Which layers attend through `sliding_window`: "none" (every layer is global; a config asking for windows is
    # refused), "all" (Mistral), "layer_types" (the layers the config's `layer_types` marks sliding_attention; a
    # config without that list: every `window_pattern`-th layer is global, the others slide)
    windows: Literal["none", "all", "layer_types"] = "none"
    window_pattern: int = 0
    # RoPE parameters per layer type (`rope_parameters = {"full_attention": ..., "sliding_attention": ...}`, or the
    # legacy `rope_local_base_freq` for the sliding layers) instead of one set for every layer (Gemma 3)
    rope_per_layer_type: bool = False
    rope_types: tuple[str, ...] = ("default", "llama3")  # RoPE types the global layers may use
    # The config key of the attention logits' soft-cap; None: the family's attention takes none (transformers'
    # Gemma 3 ignores `attn_logit_softcapping`, so this runner does too)
    attn_softcap_key: str | None = "attn_logit_softcapping"
    # Defaults of transformers' config class for keys a config.json may leave out (older Gemma checkpoints)
    defaults: tuple[tuple[str, Any], ...] = ()


_GEMMA = dict(unit_offset_norm=True, sandwich_norms=True, embed_scale=True, activation_key="hidden_activation",
              windows="layer_types")
_GEMMA_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256), ("query_pre_attn_scalar", 256),
                   ("sliding_window", 4096), ("rms_norm_eps", 1e-6), ("tie_word_embeddings", True))

FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(windows="all"),
    "qwen2": Family(qkv_bias_default=True),
    "qwen3": Family(qk_norm=True),
    "gemma2": Family(**_GEMMA, window_pattern=2, defaults=_GEMMA_DEFAULTS + (
        ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0))),
    "gemma3_text": Family(**_GEMMA, qk_norm=True, window_pattern=6, rope_per_layer_type=True,
                          rope_types=("default", "linear"), attn_softcap_key=None, defaults=_GEMMA_DEFAULTS),
}

# MLP gate activations, computed exactly as transformers' ACT2FN computes them
ACTIVATIONS: dict[str, Callable] = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def with_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The config with its family's defaults under it (keys the config sets win, None values included)."""
    family = FAMILIES.get(config.get("model_type"))
    return config if family is None else {**dict(family.defaults), **config}


def layer_types(config: dict[str, Any], family: Family) -> tuple[bool, ...]:
    """Per layer: True where it attends through the sliding window (config already `with_defaults`)."""
    n = config["num_hidden_layers"]
    if family.windows == "none" or config.get("sliding_window") is None:
        return (False,) * n
    if family.windows == "all":
        return (True,) * n
    types = config.get("layer_types")
    if types:
        return tuple(t == "sliding_attention" for t in types)
    pattern = config.get("sliding_window_pattern", family.window_pattern)
    return tuple(bool((i + 1) % pattern) for i in range(n))


def rope_sets(config: dict[str, Any], family: Family) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(parameters of the global layers, parameters of the sliding layers or None: the same). Each is a dict with
    at least `rope_theta` and `rope_type`, read from transformers-5 `rope_parameters` or the older keys."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    if not family.rope_per_layer_type:
        merged = {**legacy, **params}
        merged.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        return _typed(merged), None
    full = {**legacy, **(params.get("full_attention") or {})}
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local = dict(params.get("sliding_attention") or {})
    local.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return _typed(full), _typed(local)


def _typed(params: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    out["rope_theta"] = float(out["rope_theta"])
    return out


def family_reason(config: dict[str, Any]) -> str | None:
    """None when the fast path runs this config exactly, else a short reason (config already `with_defaults`)."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        return f"model_type {model_type!r} is not one of {sorted(FAMILIES)}"
    act = config.get(family.activation_key) or "silu"
    if act not in ACTIVATIONS:
        return f"{family.activation_key} {act!r} (only {', '.join(ACTIVATIONS)})"
    top = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if not family.rope_per_layer_type and any(isinstance(v, dict) for v in top.values()):
        return "per-layer rope parameters"
    full, local = rope_sets(config, family)
    for params, allowed in ((full, family.rope_types), (local, ("default",))):
        if params is None:
            continue
        if params["rope_type"] not in allowed:
            return f"rope_type {params['rope_type']!r} (only {' and '.join(allowed)})"
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            return "partial_rotary_factor != 1"
    windows = config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or [])
    if family.windows == "none" and windows:
        return f"{model_type} per-layer sliding window attention"
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention"
    if config.get("pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp != 1"
    return None
