"""Acceptance at the coordinator, for one request row, in plain Python.

`pipeline.rejection.accept` is the reference (tensors, batched); the coordinator runs this once per step and
request, where torch's per-op overhead made the tensor version cost ~0.8 ms on this machine. Both draw the
acceptance uniforms from the same counter-based hash of (seed, step) (`pipeline.rng`), so the results are
identical (tests/test_serve_units.py checks both against the pipeline on random cases).
"""

from __future__ import annotations

from typing import Any


def accept_row(verdict: dict[str, Any], draft_tokens: list[int], seed: int, step: int) -> tuple[int, list[int]]:
    """-> (accepted draft tokens n, emitted tokens draft[:n] + [recovered or bonus]).

    verdict: the target worker's {"accept_probs": [K], "target_tokens": [K+1]}. Uniforms are computed only
    when some acceptance probability is strictly between 0 and 1 (never for greedy).
    """
    probs, targets = verdict["accept_probs"], verdict["target_tokens"]
    K = len(draft_tokens)
    assert len(probs) == K and len(targets) == K + 1, f"verdict for K={len(probs)}, draft has {K}"
    u = uniforms(seed, step, STREAM_ACCEPT, K) if any(0.0 < q < 1.0 for q in probs) else [0.5] * K
    n = 0
    while n < K and u[n] < probs[n]:
        n += 1
    return n, [*draft_tokens[:n], int(targets[n])]


_MASK32 = 0xFFFFFFFF
STREAM_ACCEPT = 2  # pipeline.rng.Stream.ACCEPT


def _pcg(x: int) -> int:
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def uniforms(seed: int, step: int, stream: int, num: int) -> list[float]:
    """pipeline.rng.uniform for one row, in plain Python (same PCG hash on 32-bit words)."""
    h = _pcg(seed & _MASK32)
    h = _pcg(h ^ ((seed >> 32) & _MASK32))
    h = _pcg(h ^ (step & _MASK32))
    key = _pcg(h ^ stream)
    return [(_pcg(_pcg(key ^ i)) + 0.5) / 4294967296.0 for i in range(num)]
