"""Choosing K (draft tokens per target pass) each step from measured step costs and measured acceptance.

Model (Leviathan et al. 2023, section 3.1): each drafted token is accepted with probability alpha, independently,
until the first rejection. A step with K drafts then emits, per row,

    expected_tokens(alpha, K) = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)

tokens (accepted + one recovered or bonus token); K = 0 is plain decoding, exactly 1 token. A drafter may propose
nothing for some rows (prompt lookup, where the context does not repeat): with a share `coverage` of the rows
drafting, a row emits 1 + coverage * (expected_tokens - 1) on average (`row_tokens`). A step of B rows
costs cost(B, K) seconds (drafting + the target pass + bookkeeping), measured on this machine as it runs.
The chosen K maximises B * row_tokens / cost over the candidates, K = 0 included, so when the target
turns compute-bound under load (verifying K+1 tokens per row costs more than decoding one) or acceptance
drops, speculation switches itself off: throughput with it on does not fall below throughput with it off,
up to the exploration steps that keep the measurements fresh (one step at a neighbouring K or at K = 0, at
most one step in `explore_every`, rarer while the answer holds).

Acceptance is a censored geometric observation: a row that drafted n tokens and had a accepted shows
a successes and, if a < n, one failure. The estimate is the Beta(1, 1)-prior posterior mean over
exponentially decayed counts.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens emitted per row by a step with k drafts, each accepted with probability alpha."""
    assert k >= 0, f"k must be >= 0, got {k}"
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_rate(accepted: float, rejected: float, prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """Posterior mean of alpha from `accepted` successes and `rejected` first failures."""
    a, b = prior
    return (accepted + a) / (accepted + rejected + a + b)


def best_k(alpha: float, costs: dict[int, float], coverage: float = 1.0) -> int:
    """argmax over k of row_tokens(alpha, k, coverage) / costs[k]; ties go to the smaller k."""
    assert costs, "need at least one measured candidate"
    return max(sorted(costs), key=lambda k: (row_tokens(alpha, k, coverage) / costs[k], -k))


def row_tokens(alpha: float, k: int, coverage: float = 1.0) -> float:
    """Mean tokens per row of a step asking for k drafts, when only a `coverage` share of the rows gets any (prompt
    lookup drafts only where the context repeats); the others emit exactly one token."""
    return 1.0 + coverage * (expected_tokens(alpha, k) - 1.0)


def batch_bucket(batch: int) -> int:
    """Costs are kept per power-of-two batch size: 1, 2, 4, 8, ..."""
    assert batch >= 1, f"batch must be >= 1, got {batch}"
    return 1 << (batch - 1).bit_length()


def default_candidates(max_k: int) -> tuple[int, ...]:
    """0, 1, 2, 3, 4, then every other value up to max_k, and max_k itself."""
    small = [k for k in range(0, min(max_k, 4) + 1)]
    return tuple(sorted(set(small + list(range(6, max_k + 1, 2)) + [max_k])))


def interpolate_costs(measured: dict[int, float], ks: Sequence[int]) -> dict[int, float]:
    """Cost of every k in ks from the measured ones: linear between measured neighbours, and past the largest
    measured k the slope of the last two (never negative); below the smallest, that one's cost."""
    assert measured, "need at least one measured k"
    known = sorted(measured)
    out = {}
    for k in ks:
        if k in measured:
            out[k] = measured[k]
        elif k < known[0]:
            out[k] = measured[known[0]]
        elif k > known[-1]:
            slope = 0.0
            if len(known) >= 2:
                k0, k1 = known[-2], known[-1]
                slope = max((measured[k1] - measured[k0]) / (k1 - k0), 0.0)
            out[k] = measured[known[-1]] + slope * (k - known[-1])
        else:
            hi = next(j for j in known if j > k)
            lo = max(j for j in known if j < k)
            out[k] = measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo)
    return out


@dataclass
class AdaptiveK:
    """Per-step K policy: `choose` before a step, `observe` after it.

    Per batch bucket it first measures K = 0 and the smallest K > 0, extrapolates the cost of larger K
    linearly from them (and from every K measured later), and runs the best predicted K, which measures it.
    Every `explore_every` steps (doubling while the best K stays the same) it runs once whichever of the best K's
    neighbours and K = 0 was measured longest ago, so the costs and the acceptance estimate stay fresh (K = 0
    alone would never observe acceptance), and so does the cost speculation has to beat (H100, 32 streams,
    128-token answers: a K = 0 cost measured 40% high early on, never measured again, kept the policy at K = 3
    for 0.93x of speculation off).
    A K's cost is the low median of its last `window` timed steps, so one stalled step (a GC pause) does not
    move it; a cost that rests on a single step, is older than `stale_after` steps, and is more than twice what
    the other K's costs predict for it is set aside and predicted from them instead (H100, 32 streams: one
    stalled K=4 step had kept the policy at K=1, 1.15x of speculation off where a fixed K=4 gave 1.43x).
    """

    max_k: int  # the largest K ever used (the request's num_draft_tokens caps it further)
    candidates: tuple[int, ...] = ()  # () -> default_candidates(max_k)
    min_samples: int = 1  # measurements of K = 0 and of the smallest K > 0 before predicting
    explore_every: int = 32  # first interval between exploration steps (per batch bucket)
    max_explore_every: int = 1024
    window: int = 5  # a K's cost is the low median of its last `window` timed steps
    stale_after: int = 8  # steps after which a single-step cost is predicted from the others again
    decay: float = 0.98  # per step that drafted anything (steps without drafts tell nothing), on the counts
    accepted: float = 0.0
    rejected: float = 0.0
    drafted_rows: float = 0.0  # rows that got >= 1 draft token, of `asked_rows` asked for some (decayed as the counts)
    asked_rows: float = 0.0
    steps: int = 0
    _cost: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, k) -> seconds/step
    _recent: dict[tuple[int, int], deque] = field(default_factory=dict)  # (batch bucket, k) -> last step times
    _samples: dict[tuple[int, int], int] = field(default_factory=dict)
    _last: dict[tuple[int, int], int] = field(default_factory=dict)  # step of the last measurement
    _explore: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # bucket -> (next step, interval, best)
    _warm: set = field(default_factory=set)  # (bucket, k) whose first, warm-up step was seen (and not counted)

    def __post_init__(self) -> None:
        assert self.max_k >= 0, f"max_k must be >= 0, got {self.max_k}"
        if not self.candidates:
            self.candidates = default_candidates(self.max_k)
        assert 0 in self.candidates, "K = 0 (no speculation) must be a candidate"

    @property
    def alpha(self) -> float:
        return acceptance_rate(self.accepted, self.rejected)

    @property
    def coverage(self) -> float:
        """Share of rows asked for drafts that got any (prior: all of one row)."""
        return (self.drafted_rows + 1.0) / (self.asked_rows + 1.0)

    def costs(self, batch: int) -> dict[int, float]:
        b = batch_bucket(batch)
        return {k: c for (bb, k), c in self._cost.items() if bb == b}

    def choose(self, batch: int, cap: int | None = None) -> int:
        """K for the next step of `batch` rows (at most `cap`)."""
        cap = self.max_k if cap is None else min(cap, self.max_k)
        b = batch_bucket(batch)
        cands = sorted(k for k in self.candidates if k <= cap) or [0]
        for k in reversed(cands[:2]):  # the smallest K > 0 first (a lone request starts speculating), then 0
            if self._samples.get((b, k), 0) < self.min_samples:
                return k
        measured = {k: c for (bb, k), c in self._cost.items() if bb == b and k in cands}
        # A cost resting on one step, measured a while ago, and more than twice what the other K's costs predict
        # for it, is likely a stall (a GC pause, the scheduler) rather than that K's price: predict it from the
        # others instead, so that it gets re-measured if it then looks best, instead of being ruled out for good.
        for k in [k for k in measured if self._samples.get((b, k), 0) < 2
                  and self.steps - self._last.get((b, k), 0) > self.stale_after]:
            others = {j: c for j, c in measured.items() if j != k}
            if len(others) >= 2 and measured[k] > 2 * interpolate_costs(others, [k])[k]:
                del measured[k]
        best = best_k(self.alpha, interpolate_costs(measured, cands), self.coverage)
        due, interval, last_best = self._explore.get(b, (self.steps + self.explore_every, self.explore_every, best))
        if best != last_best:  # the answer moved: look around it again soon
            due, interval = self.steps + self.explore_every, self.explore_every
        if self.steps >= due:
            interval = min(2 * interval, self.max_explore_every)
            self._explore[b] = (self.steps + interval, interval, best)
            i = cands.index(best)
            # The neighbours of the best K, and K = 0 (the baseline speculation must beat) whatever the best K:
            # whichever was measured longest ago. A cost that is never measured again never gets corrected.
            near = {cands[j] for j in (i - 1, i + 1) if 0 <= j < len(cands)} | ({0} if best != 0 else set())
            return min(sorted(near), key=lambda k: self._last.get((b, k), -1)) if near else best
        self._explore[b] = (due, interval, best)
        return best

    def observe(
        self,
        batch: int,
        k: int,  # the K the step ran with (the target pass fed K+1 tokens per row)
        seconds: float,  # wall time of the whole step
        num_draft: Sequence[int],  # per row: tokens actually drafted
        num_accepted: Sequence[int],  # per row: of those, accepted
        timed: bool = True,  # False: the step paid a one-time cost (a graph capture): acceptance only
    ) -> None:
        self.steps += 1
        key = (batch_bucket(batch), k)
        decay = self.decay if any(n > 0 for n in num_draft) else 1.0
        self.accepted, self.rejected = self.accepted * decay, self.rejected * decay
        # Coverage: of the rows of a step that drafted, how many got drafts. A host-side drafter's step where no row
        # got any arrives here as a K = 0 step (the engine trims the block): it cost a decode step and is one.
        if k > 0:
            self.drafted_rows = self.drafted_rows * self.decay + sum(1 for n in num_draft if n > 0)
            self.asked_rows = self.asked_rows * self.decay + len(num_draft)
        for n, a in zip(num_draft, num_accepted):
            self.accepted += a
            self.rejected += 1 if a < n else 0
        if not timed:
            return
        if key not in self._warm:  # the first step of a shape pays one-time costs (graph capture, compilation)
            self._warm.add(key)
            return
        recent = self._recent.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        self._cost[key] = statistics.median_low(recent)
        self._samples[key] = self._samples.get(key, 0) + 1
        self._last[key] = self.steps
