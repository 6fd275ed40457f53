"""The yardstick of a speculative step: the speedup it would give with no overhead at all.

From measured costs (a target decode step, a target verify of K+1 tokens, one draft-model step) and the measured
tokens per target pass, a step with no host work, no hops and no waiting costs K draft steps plus one verify
(the drafter and the target in turn) and emits `tokens_per_pass` tokens, where target-only decoding emits one
token a decode step. With the drafter on its own device and its work fully hidden behind verification
(`overlapped=True`), the step costs the longer of the two. "Efficiency" is a measured speedup over this ideal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ideal:
    step_ms: float  # one speculative step with no overhead
    speedup: float  # tokens_per_pass * decode_ms / step_ms: the ideal over target-only decoding
    tokens_per_s: float  # tokens_per_pass / step_ms, per stream


def ideal_speedup(decode_ms: float, verify_ms: float, draft_step_ms: float, k: int, tokens_per_pass: float,
                  overlapped: bool = False) -> Ideal:
    """The overhead-free speculative step. decode_ms: a target step feeding 1 token a row; verify_ms: feeding K+1;
    draft_step_ms: one draft-model forward (a step drafts K tokens: K forwards); tokens_per_pass: measured tokens
    emitted per target pass (1..K+1); overlapped: the K draft steps run beside the verify instead of before it."""
    if min(decode_ms, verify_ms) <= 0 or draft_step_ms < 0 or k < 0:
        raise ValueError(f"costs must be positive and k >= 0: decode {decode_ms}, verify {verify_ms}, "
                         f"draft {draft_step_ms}, k {k}")
    if not 1.0 <= tokens_per_pass <= k + 1:
        raise ValueError(f"tokens_per_pass must be in [1, K+1] = [1, {k + 1}], got {tokens_per_pass}")
    draft = k * draft_step_ms
    step = max(draft, verify_ms) if overlapped else draft + verify_ms
    return Ideal(step, tokens_per_pass * decode_ms / step, 1e3 * tokens_per_pass / step)


def efficiency(measured_speedup: float, ideal: Ideal) -> float:
    """A measured speedup over target-only, as a fraction of the ideal's."""
    return measured_speedup / ideal.speedup
