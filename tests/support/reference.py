"""The textbook speculative step (Leviathan et al. 2023, algorithm 1): one request, sequential, a reference for
tests of `pipeline.rejection`."""

from __future__ import annotations

from typing import Callable

import torch


def reference_speculative_step(
    target_probs: torch.Tensor,  # [K+1, V] (already warped)
    draft_probs: torch.Tensor,  # [K, V] (already warped)
    draft_tokens: list[int],
    rand: Callable[[], float],  # () -> float in (0, 1)
) -> list[int]:
    """The emitted tokens of one step, drawing acceptance uniforms from `rand`."""
    out: list[int] = []
    for i, tok in enumerate(draft_tokens):
        ratio = float(target_probs[i, tok]) / max(float(draft_probs[i, tok]), 1e-30)
        if rand() < min(1.0, ratio):
            out.append(tok)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if residual.sum() <= 1e-12:
            residual = target_probs[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1)))
    return out
