"""Pre-speculation: drafting step t+1 for the likely outcomes of step t while the target still verifies step t.

A step's outcome is (n, x): n of the K draft tokens accepted, then x, the target's recovered token (n < K) or its
bonus token (n = K). The next step's context is `context + draft[:n] + [x]`, so a draft prepared for that context
before the verdict arrives is ready the moment it does. Which outcomes to prepare is ranked by the drafter's own
probabilities (`rank_branches`): the chance it gives its token at position i is its confidence c_i that the target
accepts it, so

    P(n) = c_0 * ... * c_{n-1} * (1 - c_n)   for n < K,        P(K) = c_0 * ... * c_{K-1},

and the next token x is one of its top-m candidates: at n < K its distribution at position n without d_n
(renormalised), at n = K its distribution at position K (the drafter drafts one token more than K for it). A branch
scores P(n) * P(x | n); the `budget` best are drafted, all in one batched drafter call per draft position.

A drafter drafts each branch in a KV-cache slot of its own. A request owns a small group of slot keys (`group_keys`):
its own id and one key per branch. `assign_keys` gives each row of a call the key whose cached tokens share the
longest prefix with the row's context, so the slot of the branch that hit holds exactly the context the request
continues from, and a slot never needs copying. The cache protocol (keep the longest matching prefix, feed the
rest) makes every assignment correct; the choice only saves work.

Exactness: a branch changes which tokens are proposed, never how they are verified. A draft depends only on the
context and (seed, step) (`pipeline.rng`), so a branch that hits drafts the tokens a fresh draft of the same context
would have drafted: a sampled request's draft does not depend on whether its branch was ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

BRANCH_SEP = "\x1f"  # request id + BRANCH_SEP + branch number: a branch slot's key in a drafter


@dataclass(frozen=True)
class Branch:
    """One likely outcome of a step: `num_accepted` draft tokens accepted, then `token`."""

    num_accepted: int
    token: int
    score: float  # the drafter's probability of this outcome

    def tail(self, draft: Sequence[int]) -> list[int]:
        """The tokens this outcome appends to the context."""
        return [*draft[: self.num_accepted], self.token]


def rank_branches(
    tokens: Sequence[int],  # the drafter's answer: the K verified drafts, then (optional) its guess at position K
    top_ids: Any,  # [len(tokens), k] ids of the sparse distribution each token was drawn from; None: point masses
    top_probs: Any,  # [len(tokens), k] their probabilities
    num_verified: int,  # K: the drafts sent to the target
    budget: int,  # branches wanted
    top_m: int = 2,  # next-token candidates per acceptance length
) -> list[Branch]:
    """The `budget` most likely outcomes of verifying `tokens[:num_verified]`, best first (module docstring).

    Without probabilities (point masses: prompt lookup, the synthetic drafter) nothing ranks acceptance lengths or
    recovered tokens; the one branch is "all accepted, then the guess" when there is a guess."""
    K = num_verified
    if budget <= 0:
        return []
    if top_ids is None:
        return [Branch(K, int(tokens[K]), 1.0)] if len(tokens) > K else []
    ids = torch.as_tensor(top_ids[: len(tokens)], dtype=torch.int64)  # [T, k]
    probs = torch.as_tensor(top_probs[: len(tokens)], dtype=torch.float32)  # [T, k]
    drafted = torch.as_tensor(list(tokens), dtype=torch.int64)  # [T]
    own = (probs * (ids == drafted[:, None])).sum(-1).clamp(0.0, 1.0)  # [T] the drafter's confidence in its token
    reach = torch.cat([torch.ones(1), torch.cumprod(own[:K], 0)])  # [K+1] P(the first n accepted)
    candidates: list[Branch] = []
    for n in range(K + 1):
        if n == K and len(tokens) <= K:
            break  # no distribution at position K: the bonus token cannot be guessed
        if n < K:
            p_n = float(reach[n] * (1.0 - own[n]))  # rejected at n
            mass = probs[n] * (ids[n] != drafted[n])  # [k] the recovered token is not d_n
        else:
            p_n = float(reach[K])
            mass = probs[K]
        total = float(mass.sum())
        if p_n <= 0.0 or total <= 0.0:
            continue
        by_id: dict[int, float] = {}
        for i, p in zip(ids[n].tolist(), mass.tolist()):  # an id may repeat (padding at probability 0)
            if p > 0.0:
                by_id[i] = by_id.get(i, 0.0) + p
        best = sorted(by_id.items(), key=lambda kv: -kv[1])[:top_m]
        candidates += [Branch(n, i, p_n * p / total) for i, p in best]
    candidates.sort(key=lambda b: -b.score)  # stable: ties keep (n, rank) order
    return candidates[:budget]


def match_branch(tails: Sequence[Sequence[int]], context: Sequence[int], base: int) -> int:
    """The branch whose tail is exactly `context[base:]`, or -1."""
    grown = len(context) - base
    for i, tail in enumerate(tails):
        if len(tail) == grown and list(context[base:]) == list(tail):
            return i
    return -1


def group_keys(request_id: str, branches: int) -> list[str]:
    """A request's slot keys in a drafter: its own id, then one per branch."""
    return [request_id] + [f"{request_id}{BRANCH_SEP}{j}" for j in range(1, branches + 1)]


def request_of(key: str) -> str:
    """The request a slot key belongs to."""
    return key.split(BRANCH_SEP, 1)[0]


def assign_keys(
    keys: Sequence[str],  # the request's group (`group_keys`), in preference order on ties
    cached: dict[str, Sequence[int]],  # key -> the tokens its slot holds (missing: nothing)
    contexts: Sequence[Sequence[int]],  # the rows of one call, at most len(keys), most important first
) -> list[str]:
    """A distinct key per row: each row in turn takes the free key whose cached tokens share the longest prefix with
    its context."""
    assert len(contexts) <= len(keys), f"{len(contexts)} rows for a group of {len(keys)} slots"
    free = list(keys)
    out = []
    for ctx in contexts:
        ctx = list(ctx)
        best = max(range(len(free)), key=lambda j: (_common_prefix(cached.get(free[j], ()), ctx), -j))
        out.append(free.pop(best))
    return out


def _common_prefix(a: Sequence[int], b: list[int]) -> int:
    a = list(a)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the prefix equality is monotone: binary search with C-speed list compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
