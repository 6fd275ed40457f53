"""Speculative steps as device work, read back one step behind.

`DeviceLoop` steps a fixed batch of requests whose drafter is a draft model, a feature head (Medusa, EAGLE-3) or
none (target-only decoding) with every per-step value on the model's device: the drafter's catch-up and its K
draft forwards, the target's verify pass, rejection sampling (`pipeline.rejection`) and the next step's inputs are
launched back to back with no host read in between. On CUDA, with the models on the graph path and its
device-side attention, the whole step is captured as one CUDA graph: a step costs the host one replay and one
asynchronous copy.

The host reads step t's verdicts (accepted count and emitted tokens per row) through pinned memory after it has
launched step t+1, so committing tokens, detokenising and streaming overlap the device's next step instead of
sitting between two steps. The price is at most one step computed past a request's end, whose tokens are
dropped: a row that finished is frozen for the steps after it (its position and drafter state stop moving).

It is the same algorithm as `pipeline.step` with a `ModelDrafter`: the same drafter sampling (`sparse_draft`,
its uniforms keyed by (seed, step)), the same `verify` and `accept`, hence greedy output equal to the target's
and sampled output following the target's distribution, reproducible from the seed. What differs is only how
the drafter catches up: it always feeds two positions (the last accepted draft, if all K were, and the bonus or
recovered token), where `ModelDrafter` feeds the tokens its cache lacks.

A synthetic-acceptance drafter (`pipeline.synthetic`) runs here too: its proposals per output position are given
as `overrides`, the draft model's forwards run for their cost and its own tokens are replaced.

A feature head (`pipeline.heads.drafter.HeadDrafter`) drafts with that module's functions (`medusa_draft`,
`eagle3_chain`, the same `sparse_draft` and DRAFT uniforms). The verify pass returns the states the head reads
(`forward_features`; `GraphCausalLM.forward_static_features` when captured) for its K+1 fed positions; the loop
keeps them with the emitted tokens as the next step's pairs (feature of position p, token p+1), K+1 columns and the
count accepted + 1. Medusa drafts from the last valid column's final normed state in one pass. EAGLE-3 reads all
K+1 columns into its slot-indexed cache (columns past the accepted ones write positions that its drafts and the next
catch-up overwrite before any query reads them), then drafts on from the last valid one; captured, its attention
reads a fixed span of its slot under a mask (`Eagle3Head.step(span=)`; `pipeline.engine.head_span`: a power of two
past every position the batch can reach), so no shape depends on a position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from pipeline.drafters import sparse_draft
from pipeline.heads.drafter import HeadDrafter, PendingPairs, eagle3_chain, medusa_draft
from pipeline.models.base import CausalLM
from pipeline.rejection import DraftBlock, accept, verify
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs


@dataclass
class Overrides:
    """A synthetic drafter's proposals: row b's draft for absolute position q is `tokens[b, q - start[b]]` while
    that index is in range, else what `SyntheticDrafter` proposes past its recording."""

    tokens: torch.Tensor  # [B, P] int64
    start: torch.Tensor  # [B] int64: the absolute position of tokens[:, 0]
    vocab_size: int


def device_resident(model: CausalLM) -> bool:
    """Whether `model` runs a forward with its positions on the device and no host read (graph path with the
    Triton attention), so a step can be captured whole; other runners still step, with their own syncs."""
    check = getattr(model, "device_resident", None)
    return bool(check and check())


def _forward_fn(model: CausalLM) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """tokens [B, T], positions [B], slots [B] (all on the device) -> logits [B, T, V]."""
    if device_resident(model):
        return model.forward_static
    return lambda tokens, positions, slots: model.forward(tokens, positions, slots)


def _features_fn(model: CausalLM, layers: tuple[int, ...]) -> Callable:
    """tokens [B, T], positions [B], slots [B] -> (logits [B, T, V], the states of `layers` [B, T, F])."""
    if device_resident(model):
        return lambda tokens, positions, slots: model.forward_static_features(tokens, positions, slots, layers)
    return lambda tokens, positions, slots: model.forward_features(tokens, positions, slots, layers)


class DeviceLoop:
    """One batch shape's step (B rows, K drafts, the sampling flags), reusable: `start` loads new rows into its
    fixed tensors, so a captured graph serves every batch of that shape."""

    def __init__(
        self,
        target: CausalLM,
        batch: int,
        sampling: SamplingTensors,  # its flags are fixed for this loop; `start` loads each batch's values
        k: int,  # draft tokens per step (0: target-only decoding)
        drafter: CausalLM | None = None,  # the draft model, on the target's device
        draft_top_k: int = 20,
        out_ids: torch.Tensor | None = None,  # the drafter's reduced output vocabulary (`ModelDrafter._out_ids`)
        overrides: Overrides | None = None,  # a synthetic drafter's (a measurement aid); `start` loads each batch's
        capture: bool | None = None,  # one CUDA graph per step; None: when both models are device-resident
        head: HeadDrafter | None = None,  # a feature head instead of a draft model (its weights on the target's device)
        head_span: int | None = None,  # EAGLE-3 captured: cache positions its attention reads (past every query the
        # batch can reach); None: its whole cache
    ) -> None:
        if k < 0 or (k > 0) != (drafter is not None or head is not None) or (drafter is not None and head is not None):
            raise ValueError(f"a device loop drafts K > 0 tokens exactly when it has one draft model or head (K = {k})")
        self.target, self.drafter, self.k, self.top_k = target, drafter, k, draft_top_k
        self.head = head
        self.depth = k  # most drafts a row verifies a step (Medusa: at most its number of heads)
        self.device = dev = torch.device(getattr(target, "device", "cpu"))
        self.B = B = batch
        self.sampling = SamplingTensors(*(t.clone().to(dev) for t in (sampling.temperature, sampling.top_k,
                                                                        sampling.top_p, sampling.seeds)),
                                        sampling.all_greedy, sampling.any_greedy, sampling.needs_truncation)
        self.out_ids = None if out_ids is None else out_ids.to(dev)
        self.overrides = None if overrides is None else Overrides(overrides.tokens.clone().to(dev),
                                                                  overrides.start.clone().to(dev),
                                                                  overrides.vocab_size)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.t_slots, self.d_slots = zeros(B), zeros(B)
        # The step's state, updated in place by every step (static addresses for a captured graph).
        self.last = zeros(B)  # pending token (not yet in the target's cache)
        self.pos = zeros(B)  # its position
        self.d_feed = zeros(B, 2)  # the drafter's catch-up tokens
        self.d_pos = zeros(B)  # position of d_feed[:, 0]
        self.d_read = zeros(B)  # which catch-up position's logits to draft from
        self.steps = zeros(B)
        self.left = zeros(B)  # tokens each row may still emit (max_tokens)
        self.active = torch.ones(B, dtype=torch.bool, device=dev)
        self.result = zeros(B, k + 2)  # [num_accepted, tokens (K+1)]
        self._rows = torch.arange(B, device=dev)
        self._target_fn = _forward_fn(target)
        if drafter is not None:
            self._catch_up_fn = self._draft_fn = _forward_fn(drafter)
        if head is not None:
            # The pairs of the last verify pass, which the next step's catch-up reads (`HeadDrafter` says more):
            # the features of positions h_start .. h_start + K, each with the token after it; h_last + 1 are valid.
            self._target_fn = _features_fn(target, head.feature_layers)
            self.h_tok = zeros(B, k + 1)
            self.h_feat = torch.zeros(B, k + 1, head.feature_width, dtype=getattr(target, "dtype", torch.float32),
                                      device=dev)
            self.h_start, self.h_last = zeros(B), zeros(B)
            self.depth = k if head.depth is None else min(k, head.depth)
            # EAGLE-3's attention reads a fixed span of its slot where the step is captured (shapes independent of
            # the positions), else up to the last position (one host read, as `HeadDrafter` does)
            self._span = None
            if head.eagle and device_resident(target):
                self._span = min(head_span or head.head.max_len, head.head.max_len)
        resident = device_resident(target) and (drafter is None or device_resident(drafter))
        self.capture = (resident and dev.type == "cuda") if capture is None else capture
        if self.capture and not (resident and dev.type == "cuda"):
            raise ValueError("capturing a step needs CUDA and both models on the graph path's device attention")
        self._graph: torch.cuda.CUDAGraph | None = None
        self._host: list[torch.Tensor] = [torch.zeros(B, k + 2, dtype=torch.int64, pin_memory=dev.type == "cuda")
                                          for _ in range(2)]
        self._events: list = []  # (buffer index, event or None) of launched, unread steps, oldest first
        self._launched = 0

    # -- state ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, contexts: Sequence[Sequence[int]], steps: Sequence[int], remaining: Sequence[int],
              target_slots: Sequence[int], drafter_slots: Sequence[int] | None = None,
              sampling: SamplingTensors | None = None, overrides: Overrides | None = None,
              pairs: PendingPairs | None = None) -> None:
        """Load a batch: rows whose target cache and drafter cache hold context[:-1] (both prefilled), at
        target-pass counter `steps`, with `remaining` tokens to emit at most (a row drafts at most remaining - 1
        tokens, as `pipeline.step.draft_budgets` has it: the last token always comes from the target), in these
        cache slots, with these sampling values (the flags must be this loop's) and synthetic proposals (of this
        loop's shape). A feature head's rows come as `pairs` (`HeadDrafter.pending_pairs`, K+1 wide; its slots are
        the head's cache slots). Steps still in flight are waited for and dropped."""
        assert len(contexts) == self.B, f"a loop of {self.B} rows was given {len(contexts)}"
        for _, event in self._events:
            if event is not None:
                event.synchronize()
        self._events.clear()
        if sampling is not None:
            mine = self.sampling
            assert (sampling.all_greedy, sampling.any_greedy, sampling.needs_truncation) == (
                mine.all_greedy, mine.any_greedy, mine.needs_truncation), "another loop serves these flags"
            for t, src in zip((mine.temperature, mine.top_k, mine.top_p, mine.seeds),
                              (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seeds)):
                t.copy_(src)
        if overrides is not None:
            assert self.overrides is not None and overrides.tokens.shape == self.overrides.tokens.shape
            self.overrides.tokens.copy_(overrides.tokens)
            self.overrides.start.copy_(overrides.start)
        as_t = lambda xs: torch.tensor(list(xs), dtype=torch.int64)  # noqa: E731
        self.t_slots.copy_(as_t(target_slots))
        if drafter_slots is not None:
            self.d_slots.copy_(as_t(drafter_slots))
        self.last.copy_(as_t(c[-1] for c in contexts))
        self.pos.copy_(as_t(len(c) - 1 for c in contexts))
        self.d_feed.zero_()
        self.d_feed[:, 0] = self.last
        self.d_pos.copy_(self.pos)
        self.d_read.zero_()
        self.steps.copy_(as_t(steps))
        self.left.copy_(as_t(remaining))
        self.active.fill_(True)
        if self.head is not None:
            assert pairs is not None and pairs.tokens.shape == self.h_tok.shape, "a head's loop starts from its pairs"
            self.h_tok.copy_(pairs.tokens)
            self.h_feat.copy_(pairs.features)
            self.h_start.copy_(pairs.start)
            self.h_last.copy_(pairs.count - 1)
            self.d_slots.copy_(pairs.slots)

    @torch.inference_mode()
    def freeze(self, rows: Sequence[int]) -> None:
        """Stop rows from moving in the steps launched from now on (they finished; their verdicts are ignored)."""
        mask = torch.ones(self.B, dtype=torch.bool)
        mask[list(rows)] = False
        self.active.copy_(mask.to(self.active.device) & self.active)

    # -- one step ------------------------------------------------------------------------------------------
    def _draft(self) -> DraftBlock:
        B, K, dev = self.B, self.k, self.device
        logits = self._catch_up_fn(self.d_feed, self.d_pos, self.d_slots)[self._rows, self.d_read]  # [B, V']
        first = self.pos + 1  # position of draft token 0
        tokens = torch.zeros(B, K, dtype=torch.int64, device=dev)
        if not self.sampling.all_greedy:
            u = uniform(self.sampling.seeds, self.steps, Stream.DRAFT, K).to(dev)  # [B, K]
            top_ids = torch.zeros(B, K, self.top_k, dtype=torch.int64, device=dev)
            top_probs = torch.zeros(B, K, self.top_k, dtype=torch.float32, device=dev)
        greedy = self.sampling.all_greedy  # the draft is the argmax: what sampling a one-hot gives, without it
        for j in range(K):
            if greedy:
                token = logits.argmax(-1) if self.out_ids is None else self.out_ids[logits.argmax(-1)]
            else:
                ids, probs = sparse_draft(logits, self.sampling, self.top_k, self.out_ids)
                token = ids.gather(-1, sample_from_probs(probs, u[:, j])[:, None]).squeeze(-1)  # [B]
                top_ids[:, j, : ids.shape[1]] = ids
                top_probs[:, j, : ids.shape[1]] = probs
            if self.overrides is not None:
                token = self._override(token, first, j)
            tokens[:, j] = token
            if j + 1 < K:
                logits = self._draft_fn(token[:, None], first + j, self.d_slots)[:, 0]
        num_draft = torch.where(self.active, (self.left - 1).clamp(0, K), 0)
        if self.overrides is not None or greedy:  # point masses (as `SyntheticDrafter` ships; greedy verification
            return DraftBlock(tokens, num_draft)  # reads only the tokens)
        return DraftBlock(tokens, num_draft, top_ids, top_probs)

    def _draft_head(self) -> DraftBlock:
        """The feature head's draft, as `HeadDrafter.propose` drafts it (`medusa_draft`, `eagle3_chain`): EAGLE-3
        first reads the last pass's pairs (all K+1 columns; those past a row's accepted ones write cache positions
        that the drafts and the next catch-up overwrite before any query reads them)."""
        K, dev = self.k, self.device
        hd, depth = self.head, self.depth
        last = self.h_last.clamp(min=0)
        u = uniform(self.sampling.seeds, self.steps, Stream.DRAFT, K).to(dev)  # [B, K]
        if hd.eagle:
            logits, r = hd.head.step(self.h_tok, self.h_feat, self.h_start, self.d_slots, fused=True,
                                     span=self._span)  # [B, K+1, V'], [B, K+1, C]
            drafted = eagle3_chain(hd.head, logits[self._rows, last], r[self._rows, last], self.pos, self.d_slots,
                                   depth, self.sampling, u, self.top_k, hd._out_ids, self._span)
        else:
            drafted = medusa_draft(hd.head, self.h_feat[self._rows, last], depth, self.sampling, u, self.top_k)
        tokens, ids, probs = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, K - depth)) for t in drafted)
        ready = self.active & (self.h_last >= 0)  # a row with no pair yet drafts from its second step on
        num_draft = torch.where(ready, (self.left - 1).clamp(0, depth), 0)
        return DraftBlock(tokens, num_draft, ids, probs)

    def _override(self, token: torch.Tensor, first: torch.Tensor, j: int) -> torch.Tensor:
        """Draft j's proposal (first: each row's position of draft 0): the recorded one while in range, else
        `(pending + 1 + i) % vocab` with i counting the drafts past the recording, as `SyntheticDrafter` does."""
        o = self.overrides
        P = o.tokens.shape[1]
        idx0 = first - o.start  # [B] index of draft 0 in the recording
        idx = idx0 + j
        ok = (idx >= 0) & (idx < P)
        given = o.tokens.gather(1, idx.clamp(0, P - 1)[:, None]).squeeze(1)
        n_in = torch.where(idx0 >= 0, (P - idx0).clamp(0, self.k), 0)  # drafts of this step in range
        return torch.where(ok, given, (self.last + 1 + j - n_in) % o.vocab_size)

    def _step(self) -> None:
        B, K, dev = self.B, self.k, self.device
        if not K:
            draft = DraftBlock(torch.zeros(B, 0, dtype=torch.int64, device=dev),
                               torch.zeros(B, dtype=torch.int64, device=dev))
        else:
            draft = self._draft() if self.head is None else self._draft_head()
        fed = torch.cat([self.last[:, None], draft.token_ids], dim=1)  # [B, K+1]
        logits = self._target_fn(fed, self.pos, self.t_slots)
        if self.head is not None:
            logits, features = logits
        out = accept(verify(logits, draft, self.sampling, self.steps), draft, self.sampling.seeds, self.steps,
                     self.sampling.all_greedy)
        n = out.num_accepted  # [B]
        self.result[:, 0] = n
        self.result[:, 1:] = out.tokens
        bonus = out.tokens[self._rows, n]
        act = self.active
        if self.head is not None:  # the pairs of the positions just committed: pending + accepted drafts
            self.h_feat.copy_(torch.where(act[:, None, None], features, self.h_feat))
            self.h_tok.copy_(torch.where(act[:, None], out.tokens, self.h_tok))
            self.h_start.copy_(torch.where(act, self.pos, self.h_start))
            self.h_last.copy_(torch.where(act, n, self.h_last))
        elif K:
            all_in = n == K  # the last draft token never went through the drafter: feed it with the bonus
            last_draft = draft.token_ids[:, K - 1]
            feed0 = torch.where(all_in, last_draft, bonus)
            feed1 = torch.where(all_in, bonus, 0)
            self.d_feed[:, 0] = torch.where(act, feed0, self.d_feed[:, 0])
            self.d_feed[:, 1] = torch.where(act, feed1, self.d_feed[:, 1])
            self.d_pos.copy_(torch.where(act, self.pos + 1 + n - all_in.long(), self.d_pos))
            self.d_read.copy_(torch.where(act, all_in.long(), self.d_read))
        self.last.copy_(torch.where(act, bonus, self.last))
        self.pos.copy_(torch.where(act, self.pos + n + 1, self.pos))
        self.steps.add_(act.long())
        self.left.sub_(torch.where(act, n + 1, 0))

    @torch.inference_mode()
    def launch(self) -> None:
        """Enqueue one step and the copy of its verdicts to the host; returns without waiting for the device."""
        if self.capture and self._graph is None:
            self._capture()
        if self._graph is not None:
            self._graph.replay()
        else:
            self._step()
        buf = self._launched % 2
        assert len(self._events) < 2, "read a step's verdicts (collect) before launching a third"
        self._host[buf].copy_(self.result, non_blocking=self.device.type == "cuda")
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._events.append((buf, event))
        self._launched += 1

    @property
    def in_flight(self) -> int:
        """Steps launched and not yet read."""
        return len(self._events)

    def collect(self) -> tuple[list[int], list[list[int]]]:
        """The oldest launched step's verdicts, waiting for it -> (accepted drafts per row, emitted tokens per
        row: the accepted drafts then the recovered or bonus token)."""
        buf, event = self._events.pop(0)
        if event is not None:
            event.synchronize()
        rows = self._host[buf].tolist()
        return [r[0] for r in rows], [r[1: r[0] + 2] for r in rows]

    def _capture(self) -> None:
        """Capture `_step` as one CUDA graph. Two eager warm-up steps on a side stream first (compilation, the
        linears' tuning, cuBLAS workspaces), as torch.cuda.graphs asks; they run on a copy of the state, which is
        restored, so the captured graph starts from the rows' true state."""
        saved = [t.clone() for t in self._state()]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
                for t, s in zip(self._state(), saved):
                    t.copy_(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        for t, s in zip(self._state(), saved):  # capturing ran nothing, but keep the rule simple: restore
            t.copy_(s)
        self._graph = graph

    def _state(self) -> list[torch.Tensor]:
        head = [self.h_tok, self.h_feat, self.h_start, self.h_last] if self.head is not None else []
        return [self.last, self.pos, self.d_feed, self.d_pos, self.d_read, self.steps, self.left, self.active, *head]
