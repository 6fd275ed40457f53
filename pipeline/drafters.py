"""Drafters: whatever proposes the K tokens the target verifies, behind one small interface.

- `ModelDrafter`: a separate causal LM with the target's vocabulary, with its own slot-indexed KV cache.
  It ships the sparse (top-k) distribution it actually sampled from, so verification stays exact.
- `CrossTokenizerDrafter` (pipeline.cross_tokenizer): a draft model of another vocabulary, through text.
- `PromptLookupDrafter`: n-gram match in the context (Saxena 2023, "Prompt Lookup Decoding"); no model,
  no probabilities (the verifier treats its drafts as point masses).
- `pipeline.suffix.SuffixDrafter`: suffix decoding over the context and earlier outputs; point masses as well.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from pipeline.compat import IncompatibleDrafter, check_compatible
from pipeline.config import (  # noqa: F401 - draft_model_spec: re-exported
    HYBRID_PREFIX,
    NO_DRAFT,
    PROMPT_LOOKUP,
    SUFFIX,
    draft_model_spec,
    is_head,
    is_self,
    is_synthetic,
    parse_self,
    parse_synthetic,
)
from pipeline.models.base import CausalLM
from pipeline.models.loader import load_model
from pipeline.models.store import resolve
from pipeline.rejection import DraftBlock
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp
from pipeline.sequence import TokenView

log = logging.getLogger(__name__)


@dataclass
class ProposeRow:
    """A row asking for drafts: one request's part of a propose call."""

    request_id: str
    context: Sequence[int]  # all committed tokens (prompt + output); the last one is not yet verified
    num_draft: int  # tokens wanted for this row (0..K)
    # Whether the row decodes greedily: only then may a drafter use what other requests taught it (a greedy output
    # is the target's argmax whatever was drafted; a seeded sampled one must not depend on earlier requests).
    greedy: bool = False


class Drafter(Protocol):
    name: str

    def propose(
        self,
        rows: Sequence[ProposeRow],
        k: int,  # block width K (>= every row's num_draft)
        sampling: SamplingTensors,  # per row
        steps: torch.Tensor,  # [B] int64 target-pass counter per row (randomness key)
        draft_top_k: int,
    ) -> DraftBlock: ...

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        """Prepare a newly admitted request (prompt lookup: index its prompt; a model drafter: prefill its cache
        with all but the last token), so that one-time per-request cost is paid with the target's prefill and
        not inside a decode step, where the K policy would take it for the cost of speculating."""

    def release(self, request_id: str) -> None:
        """Forget a finished request (free its cache slot)."""

    # Optional, looked up with getattr by `pipeline.step.catch_up` (not every drafter has one): `prepare(rows)`,
    # called before `propose` with the same rows, catches up state that fell behind during steps without drafts.
    # The engine times it apart, so the K policy does not price that one-time cost into K (PromptLookupDrafter,
    # HybridDrafter). `finish(request_id, output_ids)`, called by `pipeline.step.retire` instead of `release`
    # when a request ends, lets a drafter learn from the output (SuffixDrafter's cross-request store).


class PromptLookupDrafter:
    """Propose the tokens that followed the most recent earlier occurrence of the context's last n-gram.

    `propose` keeps, per request, an index from every n-gram of the context to its latest start, extended
    by the tokens committed since the last call: a lookup costs O(new tokens), not a scan of the whole
    context (at 32 concurrent rows of 1-2k tokens the scans cost milliseconds per step on the host).
    `lookup` without a key scans; both give the same answer.
    """

    name = PROMPT_LOOKUP

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_requests: int = 4096) -> None:
        assert 1 <= min_ngram <= max_ngram, f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_requests = max_requests  # indexes kept; the least recently used goes first (rebuilt if needed)
        self._index: dict[str, _NgramIndex] = {}

    def lookup(self, context: Sequence[int], num: int, key: str | None = None) -> list[int]:
        if key is not None:
            index = self._index.pop(key, None)
            if index is None or not index.extends(context):
                index = _NgramIndex(self.min_ngram, self.max_ngram)
            self._index[key] = index  # most recently used last
            if len(self._index) > self.max_requests:
                self._index.pop(next(iter(self._index)))
            return index.lookup(context, num)
        ctx = np.asarray(context, dtype=np.int64)
        L = len(ctx)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ctx[: L - 1], n)  # [L-n, n] earlier n-grams
            hits = np.flatnonzero((windows == ctx[L - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # most recent match; its continuation starts here
                return ctx[start : start + num].tolist()
        return []

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        self.lookup(context, 0, key=request_id)  # builds the request's index over the prompt

    def prepare(self, rows) -> None:
        """Catch up the indexes of drafting rows that fell behind by more than one drafting step commits (after
        steps without drafts): a one-time cost the engine times apart from the step's. A row within one step's
        tokens is left to `propose`, so what every drafting step pays stays in its price."""
        for r in rows:
            if not r.num_draft:
                continue
            index = self._index.get(r.request_id)
            if len(r.context) - (len(index.tokens) if index is not None else 0) > r.num_draft + 1:
                self.lookup(r.context, 0, key=r.request_id)

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        return point_mass_block(self.find(rows), k)

    def find(self, rows: Sequence[ProposeRow]) -> list[list[int]]:
        """Each row's continuation (at most its num_draft tokens; [] where the context offers no match)."""
        return [self.lookup(r.context, r.num_draft, key=r.request_id) if r.num_draft else [] for r in rows]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def point_mass_block(found: Sequence[list[int]], k: int) -> DraftBlock:
    """The block of a model-free drafter: each row's tokens, no probabilities (the verifier takes each draft token
    as proposed with probability 1, which keeps the output exact at any temperature)."""
    counts = torch.tensor([len(f) for f in found], dtype=torch.int64)
    return DraftBlock(token_ids=_padded(found, k), num_draft=counts)


def _padded(rows: Sequence[list[int]], width: int) -> torch.Tensor:
    """[len(rows), width] int64, each row's ids then zeros: one tensor built from Python lists (a per-row tensor
    and slice assignment cost about 10 us a row, a millisecond a step at 32 rows)."""
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).view(len(rows), width)


class _NgramIndex:
    """For n in [min_n, max_n]: n-gram -> start of its latest occurrence that ends before the context's last
    token (the windows of context[:-1]), over a context that only grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.tokens: list[int] = []  # the context seen so far

    def extends(self, context: Sequence[int]) -> bool:
        """Whether `context` is the indexed one plus appended tokens (cheap check: length and last token)."""
        n = len(self.tokens)
        return len(context) >= n and (n == 0 or context[n - 1] == self.tokens[-1])

    def lookup(self, context: Sequence[int], num: int) -> list[int]:
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in context[old:])
        toks, L = self.tokens, len(self.tokens)
        for n, table in self.maps.items():  # add windows of toks[:L-1] starting at (old - n) .. (L - 1 - n)
            for i in range(max(old - n, 0), L - n):
                table[tuple(toks[i : i + n])] = i
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self.maps[n].get(tuple(toks[L - n :]))
            if start is not None:
                return toks[start + n : start + n + num]
        return []


class ModelDrafter:
    """A small causal LM proposing K tokens autoregressively from its own KV cache.

    Per request it remembers which tokens its cache holds (`_fed`); at each propose it keeps the longest
    prefix of those that still matches the committed context and feeds only the rest. Rejected drafts
    are thereby rolled back for free.
    """

    def __init__(self, model: CausalLM, name: str | None = None) -> None:
        self.model = model
        self.name = name or model.info.name
        self._slots: dict[str, int] = {}
        self._fed: dict[str, list[int]] = {}
        self._free: list[int] = []
        # A reduced output vocabulary (logit j means token output_token_ids[j]) when the drafter has one.
        ids = getattr(model.info, "output_token_ids", None)
        self._out_ids = None if ids is None else torch.as_tensor(ids, dtype=torch.int64)
        self.device = torch.device(getattr(model, "device", "cpu"))
        # Greedy rows ship the model's own distribution (`sparse_draft`'s greedy_spread): set where pre-speculation
        # ranks outcomes with it (a Serve drafter worker with branches); off, a greedy row ships a point mass.
        self.greedy_spread = False

    def _slot(self, request_id: str, busy: set[str]) -> int:
        """The request's cache slot (most recently used order). When all are taken, the least recently used
        request outside this call loses its slot: it is simply re-fed from its context next time."""
        if request_id in self._slots:
            self._slots[request_id] = self._slots.pop(request_id)
            return self._slots[request_id]
        if not self._free:
            used = set(self._slots.values())
            self._free = [s for s in range(self.model.num_slots) if s not in used]
        if not self._free:
            victim = next((r for r in self._slots if r not in busy), None)
            if victim is None:
                raise RuntimeError(f"a propose call of {len(busy)} rows exceeds the drafter's "
                                   f"{self.model.num_slots} slots")
            self.release(victim)
        self._slots[request_id] = self._free.pop()
        self._fed[request_id] = []
        return self._slots[request_id]

    @torch.inference_mode()
    def admit(self, request_id: str, context: Sequence[int]) -> None:
        if len(context) < 2:
            return
        slot = self._slot(request_id, {request_id})
        prompt = torch.tensor([list(context[:-1])], dtype=torch.int64, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64)  # positions and slots stay on the host: no device sync
        self.model.forward(prompt, zero, torch.tensor([slot], dtype=torch.int64), prompt.shape[1] - 1)
        self._fed[request_id] = list(context[:-1])  # propose then feeds only the last token

    def cached(self, key: str) -> Sequence[int]:
        """The tokens the cache slot of `key` (a request id, or a pre-speculation branch's key) holds."""
        return self._fed.get(key, ())

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._fed.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        B = len(rows)
        device = self.device
        logits, slots, positions = self.feed_context(rows)

        # 2. Draft K tokens, one forward per token after the first.
        out_tokens = torch.zeros(B, k, dtype=torch.int64, device=device)
        top_ids = torch.zeros(B, k, draft_top_k, dtype=torch.int64, device=device)
        top_probs = torch.zeros(B, k, draft_top_k, dtype=torch.float32, device=device)
        u = uniform(sampling.seeds, steps, Stream.DRAFT, k).to(device)  # [B, K]
        if self.greedy_spread and sampling.any_greedy:  # a greedy row takes its top entry, the argmax (u = 0: index 0)
            u = torch.where((sampling.temperature == 0).to(device)[:, None], 0.0, u)
        for j in range(k):
            ids, probs = self._sparse(logits[:, 0], sampling, draft_top_k)  # [B, k'], [B, k']
            choice = sample_from_probs(probs, u[:, j])  # [B]
            token = ids.gather(-1, choice[:, None]).squeeze(-1)  # [B]
            out_tokens[:, j] = token
            top_ids[:, j, : ids.shape[1]] = ids
            top_probs[:, j, : ids.shape[1]] = probs
            if j + 1 < k:
                logits = self.model.forward(token[:, None], positions + j, slots)  # [B, 1, V']
        fed = out_tokens[:, : k - 1].tolist()  # one device-to-host copy for the whole batch
        for b, r in enumerate(rows):
            self._fed[r.request_id].extend(fed[b])
        num_draft = torch.tensor([r.num_draft for r in rows], dtype=torch.int64, device=device)
        return DraftBlock(out_tokens, num_draft, top_ids, top_probs)

    @torch.inference_mode()
    def feed_context(self, rows: Sequence[ProposeRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's committed tokens its cache lacks -> (logits after the last one [B, 1, V'], slots [B],
        positions [B]: where the first draft token goes, i.e. the context length; slots and positions on the host)."""
        B = len(rows)
        device = self.device
        busy = {r.request_id for r in rows}
        # Positions and slots stay on the host, as the engine passes the target's: a runner reads them without a
        # device sync (on device, every one of the K forwards below waited for the one before it to finish).
        slots = torch.tensor([self._slot(r.request_id, busy) for r in rows], dtype=torch.int64)
        # 1. Catch up: feed each row's committed tokens its cache lacks (ragged; right-padded).
        pending, starts = [], []
        for r in rows:
            fed, ctx = self._fed[r.request_id], _as_list(r.context)
            keep = _common_prefix(fed, ctx)
            keep = min(keep, len(ctx) - 1)  # always re-feed at least the last token to get its logits
            pending.append(list(ctx[keep:]))
            starts.append(keep)
            self._fed[r.request_id] = ctx  # a list of its own (`_as_list`)
        # One forward, right-padded; unless a long catch-up (a fresh slot) sits beside a row far into its context,
        # whose padding would run past its cache: then a forward per row.
        width = max(len(p) for p in pending)
        groups = [list(range(B))] if max(starts) + width <= self.model.max_len else [[b] for b in range(B)]
        parts = []
        for group in groups:
            tokens = _padded([pending[b] for b in group], max(len(pending[b]) for b in group))
            last = torch.tensor([len(pending[b]) - 1 for b in group], dtype=torch.int64, device=device)
            out = self.model.forward(tokens.to(device), torch.tensor([starts[b] for b in group], dtype=torch.int64),
                                     slots[group])
            parts.append(out[torch.arange(len(group), device=device), last])  # [G, V']
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts))[:, None, :]  # [B, 1, V']
        positions = torch.tensor([len(r.context) for r in rows], dtype=torch.int64)
        return logits, slots, positions

    def _sparse(
        self, logits: torch.Tensor, sampling: SamplingTensors, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ids [B, k'] (real token ids), probs [B, k'] (sum to 1)
        return sparse_draft(logits, sampling, top_k, self._out_ids, self.greedy_spread)


def sparse_draft(
    logits: torch.Tensor,  # [B, V'] float32 draft logits (V' < V: a reduced draft vocabulary)
    sampling: SamplingTensors,  # per row
    top_k: int,
    out_ids: torch.Tensor | None = None,  # [V'] int64: logit j is token out_ids[j]; None: logit j is token j
    greedy_spread: bool = False,  # greedy rows ship the model's own distribution (temperature 1), argmax first
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [B, k'] (real token ids), probs [B, k'] (sum to 1)
    """The distribution a model drafter samples from and ships: its logits warped as the target's are, cut to the
    top-k and renormalised (the verifier gets exactly this distribution, so acceptance stays exact).

    With `greedy_spread`, a greedy row ships its unwarped distribution instead of a point mass, its argmax first (the
    caller takes entry 0): verification treats a greedy row's draft as a point mass whatever it ships
    (`pipeline.rejection`), and pre-speculation (`pipeline.prespec`) ranks a step's likely outcomes with it."""
    probs = warp(logits[:, None, :], sampling)[:, 0]  # [B, V']
    if greedy_spread and sampling.any_greedy:
        greedy = (sampling.temperature == 0).to(probs.device)[:, None]  # [B, 1]
        probs = torch.where(greedy, torch.softmax(logits.float(), dim=-1), probs)
    k = min(top_k, probs.shape[-1])
    top_probs, top_idx = probs.topk(k, dim=-1)  # [B, k]
    top_probs = top_probs / top_probs.sum(-1, keepdim=True)
    ids = top_idx if out_ids is None else out_ids.to(top_idx.device)[top_idx]
    return ids, top_probs


def _as_list(context: Sequence[int]) -> list[int]:
    """A list of the context's tokens: the engine passes a `TokenView`, whose whole slice is two list copies."""
    return context[:] if isinstance(context, TokenView) else list(context)


def _common_prefix(a: list[int], b: list[int], window: int = 64) -> int:
    """Length of the longest common prefix. Lists compare in C: whole, then all but the last `window` (a rejected
    draft differs near the end), and only then element by element in Python (4x faster at 2k tokens than the
    element loop alone: 15 against 59 us a row on the CI CPU)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = max(n - window, 0)
    if a[:i] != b[:i]:
        i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class HybridDrafter:
    """Prompt lookup where the context offers a match, a draft model everywhere else, chosen per row and step.

    A row whose context repeats its last n-gram (n >= `lookup.min_ngram`, 2 by default: a single shared token is
    weak evidence) takes the lookup's continuation, which costs nothing to produce; the other rows go to the
    draft model in one batched call. Each row ships the distribution its tokens were actually drawn from: a
    point mass for a lookup row, the model's sparse distribution for a model row, so the verification stays
    exact for greedy and sampled rows alike. The choice depends only on the context, so a seeded request
    replays exactly. The model's cache of a row that skipped it catches up on the committed tokens the next time
    the row comes to it.
    """

    def __init__(self, model: ModelDrafter, lookup: PromptLookupDrafter | None = None) -> None:
        self.model = model
        self.lookup = lookup or hybrid_lookup()
        self.name = HYBRID_PREFIX + model.name
        self.lookup_rows = self.model_rows = 0  # rows served by each, for stats and tests

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        self.lookup.admit(request_id, context)
        self.model.admit(request_id, context)

    def release(self, request_id: str) -> None:
        self.lookup.release(request_id)
        self.model.release(request_id)

    def prepare(self, rows) -> None:
        self.lookup.prepare(rows)

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        B = len(rows)
        found, to_model = lookup_first(self.lookup, rows)
        self.lookup_rows += sum(1 for f in found if f)
        self.model_rows += len(to_model)
        tokens = _padded(found, k)
        counts = torch.tensor([len(f) for f in found], dtype=torch.int64)
        # A point mass at each looked-up token: the support's other entries repeat it at probability 0.
        top_ids = tokens[:, :, None].repeat(1, 1, draft_top_k)
        top_probs = torch.zeros(B, k, draft_top_k, dtype=torch.float32)
        top_probs[:, :, 0] = (torch.arange(k)[None, :] < counts[:, None]).float()
        parents = None
        if to_model:
            idx = torch.tensor(to_model, dtype=torch.int64)
            sub = self.model.propose([rows[b] for b in to_model], k, sampling.select(to_model),
                                     steps[idx.to(steps.device)], draft_top_k).to("cpu")
            if sub.parents is not None:  # the model drafts token trees: a looked-up row is the tree of one child a node
                N = max(k, sub.k)
                tokens, top_ids, top_probs = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, N - k))
                                              for t in (tokens, top_ids, top_probs))
                parents = torch.arange(-1, N - 1, dtype=torch.int64).repeat(B, 1)  # [B, N]
                parents[idx, :sub.k] = sub.parents
            n = sub.k
            tokens[idx, :n], counts[idx] = sub.token_ids, sub.num_draft
            width = sub.top_ids.shape[-1]  # < draft_top_k for a draft vocabulary smaller than top_k
            top_ids[idx, :n, :width], top_probs[idx, :n, :width] = sub.top_ids, sub.top_probs
            top_ids[idx, :n, width:] = sub.top_ids[..., :1]  # padding: a repeated id at probability 0
        return DraftBlock(tokens, counts, top_ids, top_probs, parents)


def hybrid_lookup() -> PromptLookupDrafter:
    """The prompt lookup of a hybrid drafter: n-grams of 2 or 3 tokens; a single shared token is weak evidence
    against a draft model's guess."""
    return PromptLookupDrafter(max_ngram=3, min_ngram=2)


def lookup_first(lookup: PromptLookupDrafter, rows: Sequence[ProposeRow]) -> tuple[list[list[int]], list[int]]:
    """The hybrid rule, for `HybridDrafter` and the Serve coordinator (whose model part runs on drafter workers):
    prompt lookup first, the model elsewhere. -> (each row's looked-up drafts, indexes of the rows that want
    drafts and found none: the model's)."""
    found = lookup.find(rows)
    return found, [b for b, r in enumerate(rows) if r.num_draft and not found[b]]


def lookup_part(spec: str | None):
    """The model-free drafter a drafter spec runs in the Serve coordinator: prompt lookup (alone, or a hybrid's,
    before the model) or suffix decoding; None if it has none."""
    if spec == PROMPT_LOOKUP:
        return PromptLookupDrafter()
    if spec == SUFFIX:
        from pipeline.suffix import SuffixDrafter  # it imports this module

        return SuffixDrafter()
    return hybrid_lookup() if spec is not None and spec.startswith(HYBRID_PREFIX) else None


def build_drafter(spec: str | None, target_info, tokenizer, device: str = "cpu", dtype: str = "float32",
                  target: CausalLM | None = None):
    """A drafter from its spec (the drafter vocabulary of pipeline.config): None or "none" (no speculation),
    "prompt-lookup", "suffix" (`pipeline.suffix.SuffixDrafter`), a draft model (folder, .gguf or store name),
    "lookup+MODEL" (`HybridDrafter`), "medusa:DIR" / "eagle3:DIR" (a feature head on `target`'s hidden states,
    `pipeline.heads.drafter.HeadDrafter`), "self" / "self:window=W,sinks=N" (the target through a StreamingLLM window,
    `pipeline.self_spec.SelfSpecDrafter`), or "synthetic:ALPHA:SHAPE:RECORDING" (`pipeline.synthetic.SyntheticDrafter`,
    a measurement aid). A draft model of the target's vocabulary passes the compatibility check
    (`pipeline.compat.check_compatible`); one of another vocabulary drafts through text
    (`pipeline.cross_tokenizer.CrossTokenizerDrafter`, logged) unless `cross_tokenizer_problem` says why it cannot,
    which is then refused with that reason."""
    if spec is None or spec == NO_DRAFT:
        return None
    if spec in (PROMPT_LOOKUP, SUFFIX):
        return lookup_part(spec)
    if spec.startswith(HYBRID_PREFIX):
        if is_self(spec[len(HYBRID_PREFIX):]):
            raise ValueError(f"drafter {spec!r}: self-speculation has no '{HYBRID_PREFIX}' form; use 'self' alone")
        return HybridDrafter(build_drafter(spec[len(HYBRID_PREFIX):], target_info, tokenizer, device, dtype, target))
    if is_head(spec):
        from pipeline.heads.drafter import HeadDrafter

        if target is None:
            raise ValueError(f"drafter {spec!r} reads the target's hidden states: build it with the target model")
        return HeadDrafter.from_spec(spec, target)
    if is_self(spec):
        from pipeline.self_spec import SelfSpecDrafter  # it imports this module

        if target is None:
            raise ValueError(f"drafter {spec!r} is the target itself: build it with the target model")
        window = parse_self(spec)
        return SelfSpecDrafter(target, window.window, window.sinks)
    if is_synthetic(spec):  # a measurement aid: the recorded continuation at a set acceptance, a real model's time
        from pipeline.synthetic import SyntheticDrafter, SyntheticSelfDrafter

        synthetic = parse_synthetic(spec)
        if synthetic.self_timed:
            if target is None:
                raise ValueError(f"drafter {spec!r} spends the target's own draft time: build it with the target model")
            return SyntheticSelfDrafter(target, synthetic.recording, synthetic.alpha, name=spec)
        return SyntheticDrafter.from_spec(spec, device, dtype)
    draft_model, draft_tok = load_model(str(resolve(spec)), device=device, dtype=dtype)
    try:
        check_compatible(target_info, tokenizer, draft_model.info, draft_tok)
    except IncompatibleDrafter as err:  # another vocabulary: draft through text where that can work
        from pipeline.cross_tokenizer import CrossTokenizerDrafter, cross_tokenizer_problem

        problem = cross_tokenizer_problem(tokenizer, draft_tok)
        if problem is not None:
            raise IncompatibleDrafter(f"{err}; it cannot draft through text either: {problem}") from None
        log.info("drafter %s: its vocabulary differs from target %s's; drafting through text (point-mass drafts)",
                 draft_model.info.name, target_info.name)
        return CrossTokenizerDrafter(ModelDrafter(draft_model), tokenizer, draft_tok)
    return ModelDrafter(draft_model)
