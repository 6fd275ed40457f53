"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Snowflake's Arctic Inference): a model-free drafter over
a suffix index of the request's own context and of earlier requests' outputs.

The index (`SuffixIndex`) is a bounded-depth one: for every pattern length n in 1..max_pattern it chains the
positions where each n-gram of a growing token list ends (`heads[n]`: n-gram -> latest end; `prev[n][e]`: the
previous end of the n-gram that ends at e). Appending a token costs O(max_pattern^2) (its n-grams), a lookup walks
only the occurrences it uses, and the memory is max_pattern dict entries and list slots per token. A full suffix
tree or automaton would give unbounded match lengths, but its occurrence counts are not incremental in Python
without walking suffix links on every append; with the pattern length bounded (8 by default: SuffixDecoding's
gains come from matches of a few tokens that repeat), the chains are simpler and exact. Keys are the n-grams'
hashes; every occurrence is compared token by token before it counts, so a hash collision can cost a lookup a
step, never a wrong answer.

Drafting (`SuffixDrafter.find`): the longest suffix of the context (at most max_pattern tokens) that occurred
before, in the context itself or in the store of earlier outputs; then, among those occurrences (the most recent
`max_occurrences` of each source), the path of most frequent continuations: at each depth the token that follows
most of the occurrences still on the path (ties: the most recent occurrence's), as long as its share of all the
occurrences (SuffixDecoding's path probability) stays at least `min_prob`. The length adapts to the match: at most
`alpha * match length` tokens (and the row's budget), so a one-token match drafts little and a long one much.
The draft is a chain, the best path of the occurrences' frequency tree. Drafting the tree itself (SuffixDecoding's
best-first tree of the same budget: siblings where the occurrences disagree, verified with the target's tree
attention) accepts 0-3% more tokens per target pass on Spec-Bench summarization/RAG and agentic turns, with as many
drafted nodes, for a tree pass of 0.96-1.05x a chain pass on the CPU: no measurable gain in tokens/s
(docs/benchmarks.md, "Tried and rejected"). The chain is also what Serve's coordinator ships to the target worker.

Drafts are point masses, like prompt lookup's: the verifier treats a draft without probabilities as proposed with
probability 1, so the output is the target's exactly, greedy or sampled. Sampled rows draft from their own context
only: drafts decide which positions an accept test rather than a direct sample settles, and a draft that depended
on earlier requests would make a seeded request's output depend on what ran before it. Greedy rows, whose output
is the target's argmax whatever was drafted, use the store as well.

The store (`OutputStore`) holds finished requests' outputs, bounded in tokens: when adding one goes over the cap,
the least recently used outputs (used: added, or on the path of a draft) go until the rest fit, and the index is
rebuilt over them. One drafter holds one store, for the one target model it drafts for. In Serve it lives in each
coordinator replica (`deployments.coordinator`, where prompt lookup runs), rebuilt per replica from the requests
that replica finishes and not shared through Redis: drafting is on every token's path, and a Redis round trip per
step would cost more than the draft saves; the replicas of one app see similar traffic, so each learns the same
patterns from its own share of it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from pipeline.config import SUFFIX
from pipeline.drafters import ProposeRow, point_mass_block

SEPARATOR = -1  # between outputs in the store: no n-gram matches across it, no draft runs past it


@dataclass(frozen=True)
class SuffixConfig:
    """Settings of the suffix drafter (the word `suffix` takes these defaults)."""

    max_pattern: int = 8  # longest context suffix matched (the index's depth)
    alpha: float = 2.0  # a match of n tokens drafts at most alpha * n tokens (and the row's budget)
    min_prob: float = 0.1  # stop the draft where its path's share of the matched occurrences falls below this
    max_occurrences: int = 64  # most recent occurrences per source counted for a draft
    store_tokens: int = 32768  # the cross-request store's bound, in tokens (0: no store)
    max_requests: int = 4096  # per-request indexes kept; the least recently used goes first (rebuilt if needed)

    def __post_init__(self) -> None:
        if self.max_pattern < 1 or self.alpha <= 0 or not 0 <= self.min_prob <= 1 or self.max_occurrences < 1:
            raise ValueError(f"bad suffix drafter settings: {self}")
        if self.store_tokens < 0 or self.max_requests < 1:
            raise ValueError(f"bad suffix drafter settings: {self}")


class SuffixIndex:
    """Chains of n-gram ends (n = 1..max_pattern) over a token list that only grows. An end e is indexed once the
    token at e exists: the n-gram tokens[e-n:e] has a continuation."""

    def __init__(self, max_pattern: int) -> None:
        self.max_pattern = max_pattern
        self.tokens: list[int] = []
        self.heads: list[dict[int, int]] = [{} for _ in range(max_pattern)]  # [n-1]: hash(n-gram) -> latest end
        self.prev: list[list[int]] = [[-1] for _ in range(max_pattern)]  # [n-1][e]: previous end of that n-gram

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        start = len(toks)
        toks.extend(int(t) for t in tokens)
        for e in range(max(start, 1), len(toks)):  # ends whose continuation token just arrived
            for n in range(1, self.max_pattern + 1):
                prev, heads = self.prev[n - 1], self.heads[n - 1]
                if n > e:
                    prev.append(-1)
                    continue
                key = hash(tuple(toks[e - n:e]))
                prev.append(heads.get(key, -1))
                heads[key] = e

    def ends(self, pattern: Sequence[int], limit: int) -> list[int]:
        """Ends of the most recent occurrences (at most `limit`, most recent first) of `pattern`
        (1 <= len <= max_pattern) that have a continuation."""
        n = len(pattern)
        pat = list(pattern)
        toks, prev = self.tokens, self.prev[n - 1]
        out: list[int] = []
        e = self.heads[n - 1].get(hash(tuple(pat)), -1)
        while e >= 0 and len(out) < limit:
            if toks[e - n:e] == pat:
                out.append(e)
            e = prev[e]
        return out

    def longest_match(self, context: Sequence[int]) -> int:
        """Length of the longest suffix of `context` (at most max_pattern) that occurs here with a continuation."""
        best = 0
        for n in range(1, min(self.max_pattern, len(context)) + 1):  # occurring is monotone in n
            if not self.ends(context[len(context) - n:], 1):
                break
            best = n
        return best


def best_path(sources: Sequence[tuple[list[int], list[int]]], max_len: int, min_prob: float) -> tuple[
        list[int], list[tuple[int, int]]]:
    """The most frequent continuation of a set of occurrences: `sources` are (tokens, ends) pairs, most recent
    occurrence first; -> (the path, the (source, end) occurrences that follow it all the way)."""
    cands = [(s, e) for s, (_, ends) in enumerate(sources) for e in ends]
    total = len(cands)
    path: list[int] = []
    while len(path) < max_len and cands:
        counts: dict[int, int] = {}  # insertion order: the most recent occurrence first, for ties
        j = len(path)
        for s, e in cands:
            toks = sources[s][0]
            if e + j < len(toks) and toks[e + j] != SEPARATOR:
                counts[toks[e + j]] = counts.get(toks[e + j], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda kv: kv[1])
        if count < min_prob * total:
            break
        path.append(token)
        cands = [(s, e) for s, e in cands if e + j < len(sources[s][0]) and sources[s][0][e + j] == token]
    return path, cands


class OutputStore:
    """Earlier requests' outputs, at most `max_tokens` tokens (separators aside), in one `SuffixIndex`; the least
    recently used outputs go first."""

    def __init__(self, max_tokens: int, max_pattern: int) -> None:
        self.max_tokens, self.max_pattern = max_tokens, max_pattern
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, least recently used first
        self.num_tokens = 0
        self._next_id = 0
        self._rebuild()

    def add(self, output: Sequence[int]) -> None:
        out = [int(t) for t in output][-self.max_tokens:] if self.max_tokens else []
        if not out:
            return
        self.outputs[self._next_id] = out
        self.num_tokens += len(out)
        if self.num_tokens > self.max_tokens:
            while self.num_tokens > self.max_tokens:
                _, old = self.outputs.popitem(last=False)
                self.num_tokens -= len(old)
            self._rebuild()
        else:
            self._append(self._next_id, out)
        self._next_id += 1

    def touch(self, ends: Sequence[int]) -> None:
        """Mark the outputs holding these ends of the index as just used."""
        for e in ends:
            oid = self._ids[bisect_right(self._starts, e) - 1]
            if oid in self.outputs:
                self.outputs.move_to_end(oid)

    def _rebuild(self) -> None:
        self.index = SuffixIndex(self.max_pattern)
        self._starts: list[int] = []  # where each output starts in the index's tokens
        self._ids: list[int] = []
        for oid, out in self.outputs.items():
            self._append(oid, out)

    def _append(self, oid: int, out: list[int]) -> None:
        self._starts.append(len(self.index.tokens))
        self._ids.append(oid)
        self.index.extend(out + [SEPARATOR])


class SuffixDrafter:
    """Suffix decoding as a drafter (the module docstring says how it drafts). Per request an index of its context,
    extended by the tokens committed since the last call; across requests the `OutputStore` that `finish` feeds."""

    name = SUFFIX

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.store = OutputStore(self.config.store_tokens, self.config.max_pattern)
        self._index: OrderedDict[str, SuffixIndex] = OrderedDict()  # least recently used first

    def context_index(self, request_id: str, context: Sequence[int]) -> SuffixIndex:
        """The request's index, extended to `context` (rebuilt if `context` does not extend the indexed one)."""
        index = self._index.pop(request_id, None)
        if index is not None:
            n = len(index.tokens)
            if len(context) < n or (n and context[n - 1] != index.tokens[-1]):
                index = None
        if index is None:
            index = SuffixIndex(self.config.max_pattern)
        index.extend(context[len(index.tokens):])
        self._index[request_id] = index  # most recently used last
        if len(self._index) > self.config.max_requests:
            self._index.popitem(last=False)
        return index

    def draft(self, request_id: str, context: Sequence[int], num: int, shared: bool) -> list[int]:
        """At most `num` tokens to follow `context`; `shared`: the store may contribute (greedy rows)."""
        cfg = self.config
        own = self.context_index(request_id, context)
        if num <= 0 or len(context) < 1:
            return []
        store = self.store.index if shared and self.store.outputs else None
        indexes = [own] + ([store] if store is not None else [])
        lengths = [ix.longest_match(context) for ix in indexes]
        match = max(lengths)
        if match == 0:
            return []
        pattern = context[len(context) - match:]
        sources = [(ix.tokens, ix.ends(pattern, cfg.max_occurrences)) for ix, m in zip(indexes, lengths)
                   if m == match]
        path, followed = best_path(sources, min(num, int(cfg.alpha * match)), cfg.min_prob)
        if path and store is not None and lengths[-1] == match:
            s = len(sources) - 1
            self.store.touch([e for src, e in followed if src == s])
        return path

    # -- the Drafter interface ----------------------------------------------------------------------------------
    def admit(self, request_id: str, context: Sequence[int]) -> None:
        self.context_index(request_id, context)  # indexes the prompt with the target's prefill

    def prepare(self, rows: Sequence[ProposeRow]) -> None:
        """Catch up the indexes of drafting rows (after steps without drafts): timed apart by the engine."""
        for r in rows:
            if r.num_draft:
                self.context_index(r.request_id, r.context)

    def find(self, rows: Sequence[ProposeRow]) -> list[list[int]]:
        """Each row's draft (at most its num_draft tokens; [] where nothing matched)."""
        return [self.draft(r.request_id, r.context, r.num_draft, r.greedy) if r.num_draft else [] for r in rows]

    def propose(self, rows, k, sampling, steps, draft_top_k):
        return point_mass_block(self.find(rows), k)

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        """A request ended with `output`: the store learns it, the request's index goes."""
        self.store.add(output)
        self.release(request_id)

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
