"""Turning logits into distributions (warping) and drawing tokens from them.

Draft and target are warped by the same function with the same per-row parameters, so the rejection
sampler compares like with like and the output follows the *warped* target distribution: exactly what
plain sampling from the target with these parameters would give.

Tokens are drawn by inverse-CDF with one uniform per draw (float64 cumulative sums), so sampling is a pure
function of (distribution, uniform): no generator state, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.config import SamplingParams
from pipeline.transfer import to_device


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; 0 means off
    top_p: torch.Tensor  # [B] float32; 1 means off
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool  # host-side flags, known without a sync
    any_greedy: bool
    needs_truncation: bool  # some row uses top-k or top-p

    @staticmethod
    def from_params(params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        assert all(p.seed is not None for p in params), "seeds must be fixed before sampling (with_seed())"
        return SamplingTensors(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([p.seed for p in params], dtype=torch.int64, device=device),
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
            needs_truncation=any((p.top_k > 0 or p.top_p < 1.0) and not p.greedy for p in params),
        )

    def select(self, rows: torch.Tensor | list[int]) -> "SamplingTensors":
        if isinstance(rows, list) and rows == list(range(self.temperature.shape[0])):
            return self  # every row, in order
        idx = rows.to(self.temperature.device) if isinstance(rows, torch.Tensor) else to_device(
            rows, self.temperature.device)
        temps = self.temperature[idx]
        if self.all_greedy or not self.any_greedy:  # the flags carry over: no device sync
            all_greedy = any_greedy = self.all_greedy
        else:
            greedy = (temps == 0).tolist()
            all_greedy, any_greedy = all(greedy), any(greedy)
        return SamplingTensors(
            temperature=temps,
            top_k=self.top_k[idx],
            top_p=self.top_p[idx],
            seeds=self.seeds[idx],
            all_greedy=all_greedy,
            any_greedy=any_greedy,
            needs_truncation=self.needs_truncation,
        )


def warp(
    logits: torch.Tensor,  # [B, T, V] float32
    sampling: SamplingTensors,
) -> torch.Tensor:  # [B, T, V] float32 probabilities (greedy rows: one-hot at the argmax)
    """Temperature, then top-k, then top-p (the order Hugging Face applies them)."""
    B, T, V = logits.shape
    temp = sampling.temperature.clamp_min(1e-6)[:, None, None]  # [B, 1, 1]
    scaled = logits / temp
    if sampling.needs_truncation:
        scaled = _truncate(scaled, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if sampling.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where((sampling.temperature == 0)[:, None, None], onehot, probs)
    return probs


def _truncate(
    scaled: torch.Tensor,  # [B, T, V] temperature-scaled logits
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float32, 1 = off
) -> torch.Tensor:  # [B, T, V] with removed entries at -inf
    V = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, T, V]
    rank = torch.arange(V, device=scaled.device)  # [V]
    k = torch.where(top_k > 0, top_k, V)[:, None, None]  # [B, 1, 1]
    remove = (rank >= k).expand_as(sorted_logits)  # [B, T, V]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
    remove = remove | (mass_before >= top_p[:, None, None])  # keep the smallest prefix reaching top_p
    remove[..., 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample_from_probs(
    probs: torch.Tensor,  # [N, V] nonnegative, each row with positive mass (need not sum to 1)
    uniforms: torch.Tensor,  # [N] float64 in (0, 1)
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF draw: the first index whose cumulative mass exceeds u * total. Zero-mass entries are
    never drawn (their cumulative mass equals their predecessor's)."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [N, V]
    target = (uniforms * cdf[:, -1])[:, None]  # [N, 1]
    idx = torch.searchsorted(cdf, target, right=True)  # [N, 1]
    return idx.clamp_max(probs.shape[-1] - 1).squeeze(-1)
