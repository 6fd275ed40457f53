"""Named Llama shapes with random weights, for timing and GPU checks (no checkpoint needed).

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
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.05, generator=gen)
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


def weight_bytes_read(args: LlamaArgs, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of weights one decode step must read: every matrix once; the embedding table only where it
    doubles as the output layer (an untied model reads one row of it per token)."""
    a = args
    per_layer = (
        a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim  # q, k, v
        + a.n_heads * a.head_dim * a.dim  # o
        + 3 * a.dim * a.intermediate_size  # gate, up, down
        + 2 * a.dim  # norms
    )
    total = a.n_layers * per_layer + a.dim + a.vocab_size * a.dim  # + final norm + output layer
    return total * torch.tensor([], dtype=dtype).element_size()


def kv_bytes_per_token(args: LlamaArgs, dtype: torch.dtype = torch.bfloat16) -> int:
    return args.n_layers * 2 * args.n_kv_heads * args.head_dim * torch.tensor([], dtype=dtype).element_size()
