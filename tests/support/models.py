"""Tiny random HF model folders for tests (token ids only; no tokenizer is written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

Arch = Literal["llama", "qwen2", "mistral"]


def make_tiny_llama(
    path: str | Path,
    *,
    vocab_size: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,  # None: 2 * hidden
    tie: bool = False,
    max_position_embeddings: int = 256,
    seed: int = 0,
    arch: Arch = "llama",
    rope_scaling: dict[str, Any] | None = None,  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    sliding_window: int | None = None,  # mistral only
    eos_token_id: int | list[int] | None = 2,
) -> Path:
    """Write a randomly initialised Llama-family model (safetensors + config.json) to `path`."""
    import transformers

    assert hidden % heads == 0, f"hidden {hidden} must be divisible by heads {heads}"
    assert heads % kv_heads == 0, f"heads {heads} must be a multiple of kv_heads {kv_heads}"
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=eos_token_id,
    )
    if rope_scaling is not None:
        common["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
    else:
        raise ValueError(f"unknown arch {arch!r}: expected llama, qwen2 or mistral")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF initialises with std 0.02: logits would be nearly uniform. Larger weights make the comparison
    # against the reference sensitive to mistakes (wrong RoPE, wrong mask) without overflowing.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1 if p.dim() == 1 else hidden**-0.5)
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_gpt2(path: str | Path, *, vocab_size: int = 128, hidden: int = 64, layers: int = 2,
                   heads: int = 4, seed: int = 0) -> Path:
    """Write a randomly initialised GPT-2 (a non-Llama architecture, for the generic runner)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(path)
    model.save_pretrained(out, safe_serialization=True)
    return out


class NoTreeRunner:
    """A runner of the interface without `supports_tree` or `compact` (as the CUDA graph path): wraps a fast-path
    model, to check that trees fall back to chains on such a target."""

    def __init__(self, inner) -> None:
        self.inner, self.info = inner, inner.info

    def __getattr__(self, name: str):
        if name in ("supports_tree", "compact"):
            raise AttributeError(name)
        return getattr(self.inner, name)
