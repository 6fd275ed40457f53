"""Pure-torch Llama-family runner (Llama, Mistral, Qwen2/3, Gemma 2/3, SmolLM2) with a slot-indexed KV cache.

Numerics follow HF transformers' `LlamaForCausalLM` (RMSNorm in float32 then cast back and scaled,
non-interleaved RoPE with `rotate_half`, SiLU-gated MLP), so float32 logits agree with HF to ~1e-5. What the
other families change (q/k norms, Gemma's norms, GeGLU, soft-capping, per-layer windows and RoPE bases) is a
`families.Family` entry plus the numbers in `LlamaArgs`; the modules below read them, nothing else does.

KV cache layout, per layer: `k_cache`, `v_cache` of shape `[num_slots, n_kv_heads, max_len, head_dim]`.
Heads sit before positions so that the keys of a batch, `k_cache[slots, :, :kv_len]`, come out as
`[B, n_kv_heads, kv_len, head_dim]`: exactly what `scaled_dot_product_attention` takes.
A forward call writes K/V of row b's tokens at `(slots[b], :, positions[b] + t)` and lets the query at
absolute position p see keys at positions <= p of its own slot (a per-row causal mask). Entries beyond
p are stale leftovers of rejected drafts; they are never attended to and get overwritten later.
A forward with `stream=(window, sinks)` (StreamingLLM attention: the self-speculation drafter's,
pipeline.self_spec) lets the query at p see only the keys at positions < sinks and in (p - window, p]: keys keep
their original positions (RoPE as cached); nothing is moved or evicted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pipeline.models.base import ModelInfo
from pipeline.models.families import (
    ACTIVATIONS,
    FAMILIES,
    Family,
    family_reason,
    layer_types,
    rope_sets,
    with_defaults,
)
from pipeline.models.tree_attention import TreeMask, tree_rope_and_mask

FAST_PATH_MODEL_TYPES = frozenset(FAMILIES)
FINAL_NORMED = -1  # `forward_features`: the last layer's output after the final norm (the output layer's input)


# ----------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # may differ from dim // n_heads (e.g. Mistral-Nemo)
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None (plain RoPE) or a "llama3" parameter dict
    tie_embeddings: bool  # output layer shares the embedding matrix
    qkv_bias: bool  # Qwen2: biases on q/k/v projections
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # a query at p sees keys in (p - window, p] (on `sliding_layers`); None: no window
    max_position_embeddings: int
    family: Family = Family()  # what the decoder layer changes from Llama's (families.py)
    activation: str = "silu"  # the MLP gate: "silu" or "gelu_pytorch_tanh" (GeGLU)
    sliding_layers: tuple[bool, ...] | None = None  # per layer: attends through the window; None: every layer
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta everywhere
    attn_scale: float | None = None  # the attention logits' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap) before the mask; None: none
    final_softcap: float | None = None  # the same on the output logits

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every earlier position)."""
        slides = self.sliding_layers is None or self.sliding_layers[layer]
        return self.sliding_window if slides else None

    def local_rope(self, layer: int) -> bool:
        """Layer `layer` rotates by the sliding layers' own RoPE base."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "LlamaArgs":
        """Build from an HF config dict (config.json, or `PretrainedConfig.to_dict()`)."""
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"config not supported by the Llama fast path: {reason}")
        config = with_defaults(config)
        n_heads = config["num_attention_heads"]
        family = FAMILIES[config["model_type"]]
        theta, scaling = _rope_params(config)
        local = rope_sets(config, family)[1]
        attention_bias = bool(config.get("attention_bias", False))
        sliding = layer_types(config, family)
        scalar = config.get("query_pre_attn_scalar")
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias_default or attention_bias,
            o_bias=not family.qkv_bias_default and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=config.get("sliding_window") if any(sliding) else None,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            family=family,
            activation=config.get(family.activation_key) or "silu",
            sliding_layers=sliding,
            local_rope_theta=None if local is None else local["rope_theta"],
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_softcap=config.get(family.attn_softcap_key) if family.attn_softcap_key else None,
            final_softcap=config.get("final_logit_softcapping"),
        )


def _rope_params(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) of the global layers, from either transformers-5 `rope_parameters` or
    the older `rope_theta` + `rope_scaling` keys."""
    params = rope_sets(config, FAMILIES[config["model_type"]])[0]
    theta, rope_type = params["rope_theta"], params["rope_type"]
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, scaling


def unsupported_reason(config: dict[str, Any]) -> str | None:
    """None when the fast path runs this config exactly, else a short reason (for the fallback log)."""
    return family_reason(with_defaults(config))


# ----------------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back to the input dtype, then scale. `unit_offset` (Gemma):
    scale by (1 + weight) in float32, then cast."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:  # [..., C] -> [..., C]
    """HF LlamaRMSNorm as a function of tensors: normalise in float32, cast back, then scale. `unit_offset`
    (Gemma): scale by (1 + weight) in float32, then cast."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap



def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; cos, sin: [B, T, 1, D] (same dtype as x)
    return x * cos + rotate_half(x) * sin


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, as HF computes them (default or llama3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    assert scaling["rope_type"] == "llama3", f"unsupported rope_type {scaling['rope_type']!r}"
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.scale = a.attn_scale if a.attn_scale is not None else a.head_dim**-0.5
        self.softcap = a.attn_softcap
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        if a.family.qk_norm:  # over each head's D features, shared by the heads
            self.q_norm = RMSNorm(a.head_dim, a.norm_eps, a.family.unit_offset_norm)
            self.k_norm = RMSNorm(a.head_dim, a.norm_eps, a.family.unit_offset_norm)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, C]
        cos: torch.Tensor,  # [B, T, 1, D]
        sin: torch.Tensor,  # [B, T, 1, D]
        mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
        k_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
        v_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
        slots: torch.Tensor,  # [B]
        pos: torch.Tensor,  # [B, T] absolute position of every fed token
    ) -> torch.Tensor:  # [B, T, C]
        B, T, _ = x.shape
        S = mask.shape[-1]
        q = linear(self.wq, x).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = linear(self.wk, x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = linear(self.wv, x).view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Advanced indices split by a slice put their broadcast dims first: the target is [B, T, Hkv, D].
        k_cache[slots[:, None], :, pos] = k
        v_cache[slots[:, None], :, pos] = v
        if self.softcap is not None or (x.device.type == "cpu" and T <= _CPU_SMALL_ROWS):
            y = _stacked_attention(q, k_cache, v_cache, slots, mask, self.scale, self.softcap)
        else:
            keys = k_cache[:, :, :S].index_select(0, slots)  # [B, Hkv, S, D]
            values = v_cache[:, :, :S].index_select(0, slots)  # [B, Hkv, S, D]
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )  # [B, H, T, D]
        return linear(self.wo, y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def _stacked_attention(
    q: torch.Tensor,  # [B, T, H, D] (RoPE applied)
    k_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
    scale: float,  # the logits' scale (head_dim ** -0.5 unless the family says otherwise)
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap) before the mask
) -> torch.Tensor:  # [B, H, T, D]
    """Attention for decode/verify-sized queries on the CPU, and for every call of a family with soft-capped
    attention logits (which SDPA cannot compute): the G query heads that share a KV head are
    stacked (`[B, Hkv, G*T, D]`), so each cached key is read once with no GQA expansion, and a single row
    reads its slot in place instead of gathering a copy. For T = 2-5 torch's CPU SDPA takes its math path
    (expanding K/V per query head: 37 ms of a 90 ms step of the demo model at 1,000 positions); this path
    costs a few ms."""
    B, T, H, D = q.shape
    Hkv, S = k_cache.shape[1], mask.shape[-1]
    G = H // Hkv
    if B == 1 and slots.device.type == "cpu":  # a view: no copy of the row's keys (int() is free on the CPU)
        keys, values = k_cache[int(slots[0]), :, :S][None], v_cache[int(slots[0]), :, :S][None]
    else:
        keys, values = k_cache[:, :, :S].index_select(0, slots), v_cache[:, :, :S].index_select(0, slots)
    qs = q.permute(0, 2, 1, 3).reshape(B, Hkv, G * T, D)  # head h = kv_head * G + g
    scores = soft_cap(torch.matmul(qs, keys.transpose(-1, -2)).mul_(scale), softcap)  # [B, Hkv, G*T, S]
    scores = scores.view(B, Hkv, G, T, S).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.view(B, Hkv, G * T, S), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).view(B, H, T, D)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.act = ACTIVATIONS[a.activation]
        self.w1 = nn.Linear(a.dim, a.intermediate_size, bias=a.mlp_bias)  # gate
        self.w3 = nn.Linear(a.dim, a.intermediate_size, bias=a.mlp_bias)  # up
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=a.mlp_bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        return linear(self.w2, self.act(linear(self.w1, x)) * linear(self.w3, x))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        offset = a.family.unit_offset_norm
        self.attention_norm = RMSNorm(a.dim, a.norm_eps, offset)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, offset)
        self.feed_forward = MLP(a)
        if a.family.sandwich_norms:  # Gemma: the attention and MLP outputs are normalised before the residual add
            self.post_attention_norm = RMSNorm(a.dim, a.norm_eps, offset)
            self.post_ffn_norm = RMSNorm(a.dim, a.norm_eps, offset)
        else:
            self.post_attention_norm = self.post_ffn_norm = nn.Identity()

    def forward(self, x, cos, sin, mask, k_cache, v_cache, slots, pos) -> torch.Tensor:  # [B, T, C]
        y = self.attention(self.attention_norm(x), cos, sin, mask, k_cache, v_cache, slots, pos)
        x = x + self.post_attention_norm(y)
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        # `_weight` skips the random init (normal_ on the meta device costs seconds of first-time imports).
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, _weight=torch.empty(a.vocab_size, a.dim))
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, a.family.unit_offset_norm)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, C]
        x = self.tok_embeddings(tokens)
        if self.args.family.embed_scale:  # HF rounds the scale to the model dtype first
            x = x * torch.tensor(self.args.dim**0.5, dtype=x.dtype)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] final hidden states -> [B, T, V] float32
        return soft_cap(linear(self.output, self.norm(x)), self.args.final_softcap).float()


# ----------------------------------------------------------------------------------------------------
# Weights: the one table from HF tensor names to module parameters ({i}: layer index)

HF_TO_LOCAL: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attention.wq.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attention.wk.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attention.wv.bias",
    "model.layers.{i}.self_attn.o_proj.bias": "layers.{i}.attention.wo.bias",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "model.layers.{i}.mlp.gate_proj.bias": "layers.{i}.feed_forward.w1.bias",
    "model.layers.{i}.mlp.up_proj.bias": "layers.{i}.feed_forward.w3.bias",
    "model.layers.{i}.mlp.down_proj.bias": "layers.{i}.feed_forward.w2.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attention.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attention.k_norm.weight",
}
# Families with `sandwich_norms` (Gemma) name their four norms differently: post_attention_layernorm is the norm
# after attention, pre_feedforward_layernorm the one before the MLP.
SANDWICH_HF_TO_LOCAL: dict[str, str] = {
    **HF_TO_LOCAL,
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attention_norm.weight",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_ffn_norm.weight",
}


def _patterns(table: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in table.items()]


_HF_PATTERNS = {False: _patterns(HF_TO_LOCAL), True: _patterns(SANDWICH_HF_TO_LOCAL)}


def hf_to_local(name: str, family: Family = Family()) -> str | None:
    """Module parameter name for an HF tensor name, or None for tensors the runner does not use."""
    for pattern, local in _HF_PATTERNS[family.sandwich_norms]:
        m = pattern.match(name)
        if m:
            return local.format(i=m.group(1)) if m.groups() else local
    return None


def load_transformer(
    path: str | Path, config: dict[str, Any], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """Build the model and fill it from the folder's *.safetensors, one tensor at a time (`safe_open`),
    so that a tensor-parallel loader can later read slices (`get_slice`) instead of whole tensors."""
    args = LlamaArgs.from_hf(config)
    with torch.device("meta"):
        model = Transformer(args)
    expected = {k for k in model.state_dict() if not (args.tie_embeddings and k == "output.weight")}
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                local = hf_to_local(name, args.family)
                if local is None or local not in expected:
                    continue  # e.g. rotary_emb.inv_freq, or lm_head.weight of a tied model
                tensor = f.get_tensor(name)
                want = model.get_parameter(local).shape
                assert tensor.shape == want, f"{name}: shape {tuple(tensor.shape)} != expected {tuple(want)}"
                state[local] = tensor.to(device=device, dtype=dtype)
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(f"weights missing from {path}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval().requires_grad_(False)


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files, in index order when there is a `model.safetensors.index.json`."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


# ----------------------------------------------------------------------------------------------------
# Runner


class LlamaCausalLM:
    """`CausalLM` over a `Transformer`: owns the KV cache and the RoPE tables."""

    def __init__(self, model: Transformer, info: ModelInfo) -> None:
        self.model = model
        self.info = info
        self.args = model.args
        p = model.tok_embeddings.weight
        self.device, self.dtype = p.device, p.dtype
        self.inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling).to(self.device)
        # The sliding layers' own RoPE frequencies (Gemma 3), or None: every layer rotates by `inv_freq`.
        theta = self.args.local_rope_theta
        self.local_inv_freq = None if theta is None else rope_inv_freq(self.args.head_dim, theta, None).to(self.device)
        self.k_caches: list[torch.Tensor] = []  # per layer [num_slots, Hkv, max_len, D]
        self.v_caches: list[torch.Tensor] = []
        self._kv: torch.Tensor | None = None  # the block both are views of (`allocate`)
        self._num_slots = 0
        self._max_len = 0
        self._cos = self._sin = torch.empty(0)
        self._local_cos = self._local_sin = torch.empty(0)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_len(self) -> int:
        return self._max_len

    @torch.no_grad()
    def allocate(self, num_slots: int, max_len: int) -> None:
        assert num_slots >= 1 and max_len >= 1, f"need num_slots, max_len >= 1, got {num_slots}, {max_len}"
        a = self.args
        self.k_caches, self.v_caches, self._kv = [], [], None  # free the old cache before allocating the new one
        # One block [2 (k, v), n_layers, num_slots, Hkv, max_len, D]; each layer's k and v caches are views of it
        # (contiguous), so `compact` moves every layer's entries in one gather and one scatter.
        self._kv = torch.zeros((2, a.n_layers, num_slots, a.n_kv_heads, max_len, a.head_dim), device=self.device,
                               dtype=self.dtype)
        self.k_caches, self.v_caches = list(self._kv[0].unbind(0)), list(self._kv[1].unbind(0))
        self._num_slots, self._max_len = num_slots, max_len
        self._cos, self._sin = self._rope_table(self.inv_freq, max_len)
        if self.local_inv_freq is not None:
            self._local_cos, self._local_sin = self._rope_table(self.local_inv_freq, max_len)

    def _rope_table(self, inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_len, D], computed exactly as HF does (float32 outer product, cos/sin, cast to the dtype)."""
        freqs = torch.arange(max_len, device=self.device).float()[:, None] * inv_freq[None, :]  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B] int64 position of tokens[:, 0]
        slots: torch.Tensor,  # [B] int64 distinct cache slots
        logits_from: int = 0,
        tree: TreeMask | None = None,  # the fed tokens are nodes of a token tree (pipeline.models.tree_attention)
        stream: tuple[int, int] | None = None,  # (window, sinks): StreamingLLM attention (module docstring)
    ) -> torch.Tensor:  # [B, T - logits_from, V] float32
        return self._forward(tokens, positions, slots, logits_from, (), tree, stream)[0]

    @torch.inference_mode()
    def forward_features(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B] int64 position of tokens[:, 0]
        slots: torch.Tensor,  # [B] int64 distinct cache slots
        layers: tuple[int, ...],  # which hidden states (`FINAL_NORMED` or a layer index, see below)
        logits_from: int = 0,
        tree: TreeMask | None = None,  # the fed tokens are nodes of a token tree (pipeline.models.tree_attention)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T - logits_from, V] float32, [B, T, len(layers) * C]
        """`forward` that also returns hidden states of every fed position, concatenated in `layers` order: index
        i in [0, n_layers] is the residual stream entering layer i (n_layers: the last layer's output, before the
        final norm; EAGLE-3's auxiliary states), `FINAL_NORMED` the last layer's output after the final norm (what
        the output layer reads; Medusa's input). Plain `forward` computes none of them."""
        assert layers, "forward_features needs at least one layer"
        logits, feats = self._forward(tokens, positions, slots, logits_from, layers, tree)
        return logits, torch.cat(feats, dim=-1)

    def _forward(self, tokens, positions, slots, logits_from: int, layers: tuple[int, ...],
                 tree: TreeMask | None = None, stream: tuple[int, int] | None = None):
        assert self._max_len > 0, "call allocate(num_slots, max_len) before forward"
        assert tokens.dim() == 2, f"tokens must be [B, T], got {tuple(tokens.shape)}"
        B, T = tokens.shape
        assert positions.shape == (B,) and slots.shape == (B,), (
            f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [B={B}]"
        )
        assert 0 <= logits_from < T, f"logits_from must be in [0, {T}), got {logits_from}"
        # The one host sync: how much of the cache the longest row reads.
        kv_len = int(positions.max()) + T
        assert kv_len <= self._max_len, f"positions + T = {kv_len} exceeds max_len {self._max_len}"
        tokens, positions, slots = (t.to(self.device) for t in (tokens, positions, slots))

        a = self.args
        pos = positions[:, None] + torch.arange(T, device=self.device)  # [B, T] cache index of every fed token
        windows = {a.window(i) for i in range(a.n_layers)}
        masks: dict[int | None, torch.Tensor] = {}  # window -> [B, 1, T, S] bool, True = attend
        if tree is None:
            rope_pos = pos
            key_pos = torch.arange(kv_len, device=self.device)  # [S]
            causal = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, S]
            if stream is not None:  # the sinks and the last `window` positions (original positions, as cached)
                assert windows == {None}, "a streaming window on a model with its own sliding windows"
                causal = causal & ((key_pos[None, None, :] > pos[:, :, None] - stream[0])
                                   | (key_pos[None, None, :] < stream[1]))
            for window in windows:
                mask = causal if window is None else causal & (key_pos[None, None, :] > pos[:, :, None] - window)
                masks[window] = mask[:, None]
        else:  # RoPE by depth, each node sees the prefix and its own path
            rope_pos, masks = tree_rope_and_mask(tree, positions, T, kv_len, windows)
        rope = (self._cos[rope_pos].unsqueeze(2), self._sin[rope_pos].unsqueeze(2))  # cos, sin [B, T, 1, D]
        local_rope = rope
        if self.local_inv_freq is not None:
            local_rope = (self._local_cos[rope_pos].unsqueeze(2), self._local_sin[rope_pos].unsqueeze(2))

        x = self.model.embed(tokens)  # [B, T, C]
        found: dict[int, torch.Tensor] = {}
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.model.layers, self.k_caches, self.v_caches)):
            if layers and i in layers:
                found[i] = x
            cos, sin = local_rope if a.local_rope(i) else rope
            x = layer(x, cos, sin, masks[a.window(i)], k_cache, v_cache, slots, pos)
        if not layers:
            return self.model.logits(x[:, logits_from:]), []  # [B, T', V]
        found[a.n_layers] = x
        if FINAL_NORMED in layers:
            found[FINAL_NORMED] = self.model.norm(x)
        missing = [i for i in layers if i not in found]
        assert not missing, f"no hidden states {missing}: layers are {FINAL_NORMED} or 0..{a.n_layers}"
        return self.model.logits(x[:, logits_from:]), [found[i] for i in layers]

    __call__ = forward

    supports_tree = True  # `forward(..., tree=)` and `compact`
    supports_stream = True  # `forward(..., stream=(window, sinks))` (the graph path too)

    @torch.inference_mode()
    def compact(
        self,
        slots: torch.Tensor,  # [B] int64
        src: torch.Tensor,  # [B, M] int64 cache indices to move from (pipeline.models.tree_attention.compact_indices)
        dst: torch.Tensor,  # [B, M] int64 cache indices to move to (src == dst: nothing moves)
    ) -> None:
        """Move cache entries within each row's slot, every layer: after a tree's verification, the accepted path's
        keys and values to consecutive positions. All sources are read before any destination is written: one
        gather and one scatter over the whole cache block (`allocate`)."""
        slots, src, dst = (t.to(self.device, non_blocking=True) for t in (slots, src, dst))
        moved = self._kv[:, :, slots[:, None], :, src]  # [B, M, 2, n_layers, Hkv, D]
        self._kv[:, :, slots[:, None], :, dst] = moved


# Rows up to which the CPU path below pays; measured on the project's 2-core AMD EPYC (torch 2.13, MKL, fp32,
# 1 thread, the demo model's 30 layers + output layer streamed from memory): body linears 1 row 36 ms ->
# 26 ms (padded to 2), 2 rows 54 -> 24 ms, 3 rows 62 -> 37 ms, 5 rows 56 -> 49 ms; the 49152 x 576 output
# layer 2 rows 25 -> 6 ms, 3 rows 38 -> 8 ms, 5 rows 19 -> 11 ms. From 6 rows on the plain GEMM is as fast.
_CPU_SMALL_ROWS = 5


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [..., C_in] -> [..., C_out]
    """`layer(x)`, computed as `W @ x^T` on the CPU for decode/verify-sized inputs.

    torch's CPU GEMM (MKL) runs x @ W^T for a handful of rows far below memory bandwidth, while `W @ x^T`
    with x^T a transposed view of 2-5 columns streams W at full speed; one row is padded to two because the
    two-column kernel beats MKL's matrix-vector path. Other layer types, layers with hooks (tensor-parallel
    shards), other dtypes, GPUs and prefill-sized inputs take the ordinary call. The result equals
    `layer(x)` up to float summation order.
    """
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (
        type(layer) is not nn.Linear
        or layer._forward_hooks  # e.g. tensor parallelism's all-reduce after a row-parallel shard
        or layer._forward_pre_hooks
        or x.device.type != "cpu"
        or x.dtype != torch.float32  # bf16 GEMMs (oneDNN) are already flat from 1 to 8 rows
        or not 0 < rows <= _CPU_SMALL_ROWS
    ):
        return layer(x)
    # x^T must be a transposed view of a row-major matrix: a column-major x^T takes MKL's slow path.
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:
        flat = flat.repeat(2, 1)
    y = torch.mm(layer.weight, flat.t()).t()[:rows].contiguous()
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
