"""Named model shapes with random weights, for timing and GPU checks (no checkpoint needed).

The Llama shapes are written out; the other families' shapes are read from their published `config.json`
values through `LlamaArgs.from_hf`, as a checkpoint of that family is read (`pipeline/models/families.py`).

Random weights are fine for timing: a decode step's cost depends on shapes, not values. Values are drawn
(normal, std 1/sqrt(fan-in); norms near 1) rather than left at zero, so no kernel sees an all-zero input.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pipeline.models.base import ModelInfo
from pipeline.models.llama import LlamaArgs, LlamaCausalLM, Transformer

_COMMON = dict(norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, qkv_bias=False, o_bias=False, mlp_bias=False,
               sliding_window=None, max_position_embeddings=8192)

SHAPES: dict[str, LlamaArgs] = {
    # Llama-3-8B: 8.03B parameters, 16.06 GB in bf16.
    "llama-8b": LlamaArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                          intermediate_size=14336, tie_embeddings=False, **_COMMON),
    # Llama-3.2-1B: 1.24B parameters (tied embeddings), 2.47 GB in bf16.
    "llama-1b": LlamaArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                          intermediate_size=8192, tie_embeddings=True, **_COMMON),
}
# SmolLM2-135M (the demo target): 134.5M parameters, tied embeddings; for host-overhead profiles of its steps.
SHAPES["smollm2-135m"] = LlamaArgs(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                                   intermediate_size=1536, tie_embeddings=True,
                                   **{**_COMMON, "rope_theta": 100000.0})
# The project's drafters keep a reduced output vocabulary (pipeline/distill): the 1B shape over 32768 rows.
SHAPES["llama-1b-v32k"] = replace(SHAPES["llama-1b"], vocab_size=32768)

# Other families, from the values of their published config.json files (keys a config leaves out take the
# family's defaults in families.py, as for a real checkpoint).
_GEMMA2 = dict(model_type="gemma2", vocab_size=256000, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
               rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True)
_GEMMA3 = dict(model_type="gemma3_text", vocab_size=262208, head_dim=256, query_pre_attn_scalar=256,
               sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
               rms_norm_eps=1e-6, max_position_embeddings=131072, final_logit_softcapping=None,
               attn_logit_softcapping=None, tie_word_embeddings=True)
_FAMILY_CONFIGS = {
    # Gemma2-2B: 2.61B parameters (tied embeddings), 5.23 GB in bf16; GeGLU, sandwich norms, soft-capped attention
    # and final logits, sliding window 4096 on every other layer (the even ones).
    "gemma2-2b": dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4),
    # Gemma2-9B: 9.24B parameters (tied embeddings), 18.48 GB in bf16.
    "gemma2-9b": dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8),
    # Gemma3-4B (the text model): 3.88B parameters (tied embeddings), 7.76 GB in bf16; q/k norms, five sliding
    # layers (window 1024, RoPE base 10k) to a global one (base 1M, linear scaling x8), no soft-capping.
    "gemma3-4b": dict(_GEMMA3, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4),
    # Gemma3-12B (the text model): 11.77B parameters (tied embeddings), 23.5 GB in bf16.
    "gemma3-12b": dict(_GEMMA3, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8),
    # Qwen3-8B: 8.19B parameters (untied embeddings), 16.38 GB in bf16; RMSNorm over each query and key head.
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                     sliding_window=None),
}
SHAPES.update({name: LlamaArgs.from_hf(config) for name, config in _FAMILY_CONFIGS.items()})


def random_llama(
    args: LlamaArgs | str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> LlamaCausalLM:
    """A `LlamaCausalLM` of the given shape with random weights, built directly on `device`."""
    if isinstance(args, str):
        args = SHAPES[args]
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)  # allocated once, directly in dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # a (1 + weight) norm (Gemma) scales near 1 with weights near 0
                p.normal_(0.0 if args.family.unit_offset_norm else 1.0, 0.05, generator=gen)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02, generator=gen)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model = model.eval().requires_grad_(False)
    info = ModelInfo(
        name=f"random-{args.dim}x{args.n_layers}", path="", vocab_size=args.vocab_size, eos_token_ids=(),
        max_position_embeddings=args.max_position_embeddings, architecture="LlamaForCausalLM",
        num_parameters=sum(p.numel() for p in model.parameters()), fast_path=True,
    )
    return LlamaCausalLM(model, info)


def embedding_margin(runner: LlamaCausalLM, margin: float) -> LlamaCausalLM:
    """Scale a random model's embedding by `margin` and copy it into its (untied) output layer, in place.

    Plain random weights give near-ties, which bf16 passes of different shapes (decode T=1, verify T=K+1, other
    batch sizes) break differently, so the greedy output would depend on the K schedule and batch, and a recorded
    continuation would stop matching. Each layer adds about unit variance a dimension to the residual stream and
    the embedding margin / sqrt(dim): at 16 (dim 4096, 32 layers) the layers dominate and near-ties stay; at 512
    the fed token's embedding dominates, the greedy token is the fed token again (a constant continuation) and wins
    by most of the top logit, far beyond bf16 rounding. The values change no step's cost."""
    with torch.no_grad():
        emb = runner.model.tok_embeddings.weight
        emb.mul_(margin)
        if runner.model.output.weight is not emb:
            runner.model.output.weight.copy_(emb)
    return runner


def weight_bytes_read(args: LlamaArgs, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of weights one decode step must read: every matrix once; the embedding table only where it
    doubles as the output layer (an untied model reads one row of it per token)."""
    a = args
    per_layer = (
        a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim  # q, k, v
        + a.n_heads * a.head_dim * a.dim  # o
        + 3 * a.dim * a.intermediate_size  # gate, up, down
        + (4 if a.family.sandwich_norms else 2) * a.dim  # norms
        + (2 * a.head_dim if a.family.qk_norm else 0)  # q/k norms
    )
    if a.qkv_bias:
        per_layer += (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
    total = a.n_layers * per_layer + a.dim + a.vocab_size * a.dim  # + final norm + output layer
    return total * torch.tensor([], dtype=dtype).element_size()


def kv_bytes_per_token(args: LlamaArgs, dtype: torch.dtype = torch.bfloat16) -> int:
    return args.n_layers * 2 * args.n_kv_heads * args.head_dim * torch.tensor([], dtype=dtype).element_size()
