"""Frequency-ranked draft vocabulary (FR-Spec, EAGLE-3): the drafter's output layer covers only the tokens
the target actually writes most often.

Exactness is unaffected: the drafter's distribution is zero outside these tokens and that is the very
distribution the verifier is given, so rejection sampling still returns the target's distribution; a
token the drafter cannot write is simply never proposed (the target writes it as a recovered token).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pipeline.distill.generate import SampleSet


def token_counts(data: SampleSet, vocab_size: int, prompt_weight: float = 0.05) -> np.ndarray:
    """[V] float64 counts of answer tokens (+ `prompt_weight` x prompt tokens)."""
    counts = np.zeros(vocab_size, dtype=np.float64)
    is_answer = np.zeros(len(data.ids), dtype=bool)
    for i in range(len(data)):
        is_answer[data.offsets[i] + data.prompt_lens[i] : data.offsets[i + 1]] = True
    counts += np.bincount(data.ids[is_answer], minlength=vocab_size)[:vocab_size]
    counts += prompt_weight * np.bincount(data.ids[~is_answer], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """[size] int64 token ids: `always` first (e.g. EOS), then the most frequent (ties: lower id first)."""
    vocab_size = len(counts)
    size = min(size, vocab_size)
    forced = list(dict.fromkeys(int(t) for t in always if 0 <= t < vocab_size))
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    rest = [int(t) for t in order if int(t) not in set(forced)]
    return torch.tensor((forced + rest)[:size], dtype=torch.int64)


def coverage(counts: np.ndarray, sizes: Sequence[int]) -> dict[int, float]:
    """Fraction of (weighted) token occurrences covered by the top-n tokens, for each n."""
    s = np.sort(counts)[::-1]
    total = max(s.sum(), 1e-12)
    c = np.cumsum(s)
    return {n: float(c[min(n, len(s)) - 1] / total) for n in sizes}
