"""The speculative step's pieces: the one implementation the in-process engine and the Serve layer both call.

A step, for a batch of requests (rows):
1. budget: how many tokens each row drafts (`draft_budgets`: the request's K, never past max_tokens, and the
   adaptive K policy for greedy rows only);
2. propose: the drafter drafts them (`catch_up`, then `propose`) into a `DraftBlock`; in Serve the drafter worker
   runs this on its batch and ships each row back as a `Draft` (lists), which `pack` stacks again;
3. verify and accept: one target pass over `[pending] + draft` per row, `rejection.verify` and `rejection.accept`
   (`verify_and_accept`, target side), giving each row its `Verdict`;
4. commit: the request appends the verdict's tokens (`commit`, i.e. `RequestState.commit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from pipeline.adaptive import AdaptiveK
from pipeline.config import MAX_NUM_DRAFT_TOKENS
from pipeline.drafters import Drafter, ProposeRow
from pipeline.models.base import CausalLM
from pipeline.models.tree_attention import TreeMask, compact_indices
from pipeline.rejection import DraftBlock, accept, verify
from pipeline.sampling import SamplingTensors
from pipeline.sequence import RequestState
from pipeline.transfer import to_device

CACHE_SLACK = 72  # KV-cache positions past max_seq_len: the K+1 verify tokens and draft padding write there



def new_k_policy() -> AdaptiveK:
    """The adaptive K policy (one per engine or coordinator, over the requests it serves)."""
    return AdaptiveK(max_k=MAX_NUM_DRAFT_TOKENS)  # SpecParams' own bound; each request's K caps it further


def draft_budgets(
    states: Sequence[RequestState], k: int, policy: Optional[AdaptiveK] = None, batch: Optional[int] = None
) -> tuple[list[int], bool]:
    """Draft tokens per row this step, and whether the policy chose them (then `policy.observe` the step).

    A row drafts the request's K, never past max_tokens (the last allowed token always comes from the target).
    The policy (given `batch`, the rows it is measured over; default len(states)) sets K for greedy rows only: a
    sampled row's tokens depend on its K schedule (which positions are decided by an accept test rather than a
    direct sample), and K chosen from measured timings would make a seeded request's output irreproducible.
    Sampled rows keep the request's K."""
    adapt = policy is not None and any(s.params.greedy and min(k, s.remaining - 1) > 0 for s in states)
    k_greedy = policy.choose(batch or len(states), k) if adapt else k
    return [row_budget(k_greedy if s.params.greedy else k, s.remaining) for s in states], adapt


def row_budget(k: int, remaining: int) -> int:
    """Draft tokens for a row that wants K and may emit `remaining` more tokens: the last allowed token always comes
    from the target, so never past max_tokens."""
    return max(min(k, remaining - 1), 0)


def catch_up(drafter: Drafter, rows: Sequence[ProposeRow]) -> None:
    """The drafter's catch-up on tokens committed while it was not drafting (prompt lookup's index after a run of
    K = 0 steps; `Drafter` says more): a one-time price of switching K on, not of this K, which the engine times
    apart from the step (H100, 32 streams: an exploring K = 1 step measured 2.2x a decode step with it, and
    speculation never came back). What every drafting step pays stays in `propose`."""
    prepare = getattr(drafter, "prepare", None)
    if prepare is not None:
        prepare(rows)


def retire(drafter: Drafter, state: RequestState) -> None:
    """A request ended: a drafter with a `finish` (suffix decoding) learns its output and forgets the request;
    any other just forgets it (`release`)."""
    finish = getattr(drafter, "finish", None)
    if finish is not None:
        finish(state.request_id, state.output_ids)
    else:
        drafter.release(state.request_id)


def propose(
    drafter: Drafter,
    rows: Sequence[ProposeRow],  # at least one with num_draft > 0
    sampling: SamplingTensors,  # per row
    steps: torch.Tensor,  # [B] int64 target-pass counter per row (randomness key)
    draft_top_k: int,
) -> DraftBlock:
    """Draft every row's num_draft tokens in one drafter call."""
    draft = drafter.propose(rows, max(r.num_draft for r in rows), sampling, steps, draft_top_k)
    if draft.num_draft.device.type == "cpu":  # host-side drafters (prompt lookup): free to trim
        # Feed only as many columns as the longest proposal: a step where the lookup found nothing is a plain
        # decode (T = 1), not a verify of K padding tokens.
        draft = draft.trim(int(draft.num_draft.max()))
    return draft


def empty_block(batch: int, device: torch.device | str) -> DraftBlock:
    """No drafts (a target-only step)."""
    return DraftBlock(torch.zeros(batch, 0, dtype=torch.int64, device=device),
                      torch.zeros(batch, dtype=torch.int64, device=device))


@dataclass
class Draft:
    """One row's draft as it travels between processes: ids and the sparse distribution they were drawn from; a token
    tree's nodes (breadth first, `pipeline.tree`) with each one's parent."""

    tokens: list[int]  # d_0..d_{n-1}
    top_ids: Any = None  # [n, k] int64 array, or None: point masses (prompt lookup)
    top_probs: Any = None  # [n, k] float32 array
    parents: Optional[list[int]] = None  # [n] a tree's parent node of each node (-1: the pending token); None: a chain

    @classmethod
    def of(cls, block: DraftBlock, b: int, n: int) -> "Draft":
        """Row b's first n drafts (a tree's first n nodes) of a host-side block."""
        parents = None if block.parents is None else block.parents[b, :n].tolist()
        if block.top_ids is None:
            return cls(block.token_ids[b, :n].tolist(), parents=parents)
        # the whole support the draft sampled from (the batch's top-k), or verification is inexact;
        # numpy: 15x cheaper to pickle than torch
        return cls(block.token_ids[b, :n].tolist(), block.top_ids[b, :n].numpy().copy(),
                   block.top_probs[b, :n].numpy().copy(), parents)

    def head(self, n: int) -> "Draft":
        """The draft cut to depth n: a chain's first n tokens, a tree's nodes of depth < n (they come first)."""
        if self.parents is not None:
            depths: list[int] = []
            for p in self.parents:
                depths.append(0 if p < 0 else depths[p] + 1)
            n = sum(1 for d in depths if d < n)
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Draft(self.tokens[:n], cut(self.top_ids), cut(self.top_probs), cut(self.parents))


def pack(drafts: Sequence[Draft]) -> DraftBlock:
    """Stack rows' drafts into one host-side block of width K = the longest draft (a tree's nodes: with parents)."""
    K = max((len(d.tokens) for d in drafts), default=0)
    B = len(drafts)
    tokens = torch.zeros(B, K, dtype=torch.int64)
    num_draft = torch.tensor([len(d.tokens) for d in drafts], dtype=torch.int64)
    for b, d in enumerate(drafts):
        tokens[b, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.int64)
    top_ids = top_probs = parents = None
    if K > 0 and any(d.top_ids is not None for d in drafts):
        top_ids, top_probs = pad_sparse(drafts, K)
    if K > 0 and any(d.parents is not None for d in drafts):  # a tree: a chain row is the tree of one child a node
        parents = torch.arange(-1, K - 1, dtype=torch.int64).repeat(B, 1)  # [B, K]; padding nodes hang as a chain
        for b, d in enumerate(drafts):
            if d.parents is not None:
                parents[b, : len(d.parents)] = torch.tensor(d.parents, dtype=torch.int64)
    return DraftBlock(tokens, num_draft, top_ids, top_probs, parents)


def pad_sparse(drafts: Sequence[Draft], K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-row sparse draft distributions into [B, K, k]. Rows without probabilities become point
    masses; short rows are padded with their first id at probability 0, which leaves the dense distribution
    (`pipeline.rejection` adds up the entries of an id) unchanged."""
    k = max((d.top_ids.shape[-1] for d in drafts if d.top_ids is not None), default=1)
    B = len(drafts)
    ids = torch.zeros(B, K, k, dtype=torch.int64)
    probs = torch.zeros(B, K, k, dtype=torch.float32)
    for b, d in enumerate(drafts):
        n = len(d.tokens)
        if n == 0:
            continue
        if d.top_ids is None:
            row_ids = torch.tensor(d.tokens, dtype=torch.int64)[:, None]  # [n, 1]
            row_probs = torch.ones(n, 1)
        else:
            row_ids = torch.as_tensor(d.top_ids[:n], dtype=torch.int64)
            row_probs = torch.as_tensor(d.top_probs[:n], dtype=torch.float32)
        kk = row_ids.shape[-1]
        ids[b, :n, :kk], probs[b, :n, :kk] = row_ids, row_probs
        if kk < k:
            ids[b, :n, kk:] = row_ids[:, :1]  # probs stay 0 there
    return ids, probs


@dataclass
class Verdict:
    """One row's outcome of a target pass."""

    num_draft: int  # draft tokens verified
    num_accepted: int  # of those, accepted
    tokens: list[int]  # emitted: the accepted drafts, then the recovered or bonus token (num_accepted + 1 ids)
    # [num_accepted + 1, F] the target's hidden states at the pending token and the accepted drafts (asked for by a
    # feature head, `verify_and_accept(feature_layers=...)`); None otherwise
    features: Any = None


class _Target(Protocol):
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor: ...


def verify_and_accept(
    target: CausalLM | _Target,
    pending: torch.Tensor,  # [B] int64: each row's last committed token (not yet in the cache)
    draft: DraftBlock,  # [B, K] proposals
    positions: torch.Tensor,  # [B] int64, on the host: absolute position of each pending token
    slots: torch.Tensor,  # [B] int64, on the host: each row's KV-cache slot
    sampling: SamplingTensors,  # per row, on the target's device
    steps: torch.Tensor,  # [B] int64 target-pass counter per row, on the target's device
    feature_layers: tuple[int, ...] = (),  # hidden states a feature head reads (`forward_features`); (): none
) -> list[Verdict]:
    """One target pass over [pending] + draft per row, then verification and acceptance (pipeline.rejection).
    Reading the verdicts back is the step's one deliberate host sync.

    A tree draft (`draft.parents`) is fed with its tree mask (the target must have `supports_tree`), and the
    target's cache then keeps only the accepted path: its entries move to the positions after the pending token.
    A tree row's `Verdict.num_draft` is its tree's depth (the most tokens it could have accepted), and its
    `Verdict.features` are the states at the pending token and along the accepted path, in path order."""
    tokens = torch.cat([pending[:, None], draft.token_ids.to(pending.device)], dim=1)  # [B, K+1]
    # Positions and slots stay on the host: runners read them without a device sync, the graph path sends them with
    # the tokens in one copy, and a tensor-parallel leader broadcasts them from the host anyway.
    features = None
    tree = {}  # runners without tree attention take no `tree`
    if draft.parents is not None:  # fed position 0 is the pending token, node i is fed position i + 1
        tree["tree"] = TreeMask(torch.cat([torch.full_like(draft.parents[:, :1], -1), draft.parents + 1], dim=1))
    if feature_layers:  # a feature head reads the target's states
        logits, features = target.forward_features(tokens, positions, slots, feature_layers, **tree)  # + [B, K+1, F]
    else:
        logits = target.forward(tokens, positions, slots, **tree)  # [B, K+1, V]
    draft = draft.to(logits.device)
    out = accept(verify(logits, draft, sampling, steps), draft, sampling.seeds, steps, sampling.all_greedy)
    if out.path is not None:
        src, dst = compact_indices(to_device(positions, out.path.device) + 1, out.path)
        target.compact(slots, src, dst)
        if features is not None:  # the pending token's states, then the accepted path's, as a chain gives them
            fed = torch.cat([torch.zeros_like(out.path[:, :1]), out.path + 1], dim=1)  # [B, K+1] (past the path: 0)
            features = features.gather(1, fed[..., None].expand(-1, -1, features.shape[-1]))
    num_draft = draft.num_draft if out.depth is None else out.depth  # a tree's: its depth
    # The one host sync: each row's [drafted, accepted, emitted tokens...] in one copy.
    verdicts = torch.cat([num_draft.to(out.tokens.device)[:, None], out.num_accepted[:, None], out.tokens],
                         dim=1).tolist()
    return [Verdict(v[0], v[1], v[2: v[1] + 3], None if features is None else features[b, : v[1] + 1])
            for b, v in enumerate(verdicts)]


def commit(state: RequestState, verdict: Verdict) -> tuple[list[int], str]:
    """Append a verdict's tokens to the request (stopping at EOS, a stop string or max_tokens)
    -> (token ids committed now, text now safe to stream)."""
    return state.commit(verdict.tokens, verdict.num_draft, verdict.num_accepted)
