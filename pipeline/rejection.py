"""Speculative rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

Vocabulary, per request and per target pass:
- draft tokens d_0..d_{K-1}: proposed by the drafter, drawn from draft_probs;
- accepted tokens: the longest prefix with u_i < min(1, target_probs_i(d_i) / draft_probs_i(d_i));
- recovered token: at the first rejection i, a draw from norm(max(0, target_probs_i - draft_probs_i));
- bonus token: when all drafts are accepted, a draw from target_probs at position num_draft.
Output of a pass = accepted + (recovered | bonus): between 1 and num_draft + 1 tokens, distributed exactly
as tokens sampled one by one from the (warped) target.

The work is split where it runs (docs/architecture.md): `verify` next to the target's logits reduces the
[B, K+1, V] distributions to O(K) numbers per row (acceptance probabilities and one pre-drawn recovered
or bonus token per position); `accept` turns those into the emitted tokens with the acceptance uniforms.
Drawing a recovered token at every position in advance, each with independent randomness, and keeping
only the one at the first rejection has the same distribution as drawing it afterwards.

A draft may be a token tree (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024): `DraftBlock.parents` gives
each node's parent node, -1 for the pending token, so a chain is the tree whose node i hangs under node i-1. The
siblings under a node are verified in their order by multi-draft rejection sampling: sibling j is accepted with
min(1, residual_j(d_j) / draft_j(d_j)), where residual_0 is the target's distribution at the parent and residual_{j+1}
= norm(max(0, residual_j - draft_j)); the first accepted sibling is descended into, and if all are rejected the
recovered token is drawn from the last residual. Each sibling ships the distribution it was drawn from given its
earlier siblings (sampling without replacement renormalises the draft over the tokens not yet drawn; a point mass
for a deterministic candidate), so each sibling's test is an ordinary rejection step and the output is exactly
the target's. A chain is the special case with one child per node; a node whose draft distribution has no mass
(nothing left to draw) is never accepted and leaves the residual as it was. Greedy: the walk follows the child
equal to the target's argmax.

Draft distributions travel sparse: the drafter samples from its top-k truncated distribution and ships
exactly that (ids + probabilities), so the guarantee holds and the payload is O(K*k), not O(K*V). Drafts
without probabilities (prompt lookup) count as point masses (probability 1), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.tree_attention import tree_ancestors
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp


@dataclass
class DraftBlock:
    """What a drafter proposes for a batch; rows beyond their num_draft are padding."""

    token_ids: torch.Tensor  # [B, K] int64
    num_draft: torch.Tensor  # [B] int64, 0 <= num_draft <= K
    # [B, K, k] int64: support of the draft distribution (an id listed twice adds up)
    top_ids: torch.Tensor | None = None
    top_probs: torch.Tensor | None = None  # [B, K, k] float32: its probabilities (rows sum to 1, or 0: see above)
    # [B, K] int64: a tree's parent node of each node (< its own index; siblings in verification order), -1: the
    # pending token. None: a chain (node i under node i-1). Nodes past num_draft are padding.
    parents: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.token_ids.shape[1]

    def trim(self, k: int) -> "DraftBlock":
        """The first k columns (k >= every row's num_draft): drops all-padding columns."""
        cut = lambda t: None if t is None else t[:, :k]  # noqa: E731
        return DraftBlock(cut(self.token_ids), self.num_draft, cut(self.top_ids), cut(self.top_probs),
                          cut(self.parents))

    def to(self, device: torch.device | str) -> "DraftBlock":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return DraftBlock(move(self.token_ids), move(self.num_draft), move(self.top_ids), move(self.top_probs),
                          move(self.parents))

    def parent_positions(self) -> torch.Tensor:  # [B, K] int64
        """The fed position ([pending] + nodes) whose target distribution each node is verified against."""
        if self.parents is None:
            return torch.arange(self.k, device=self.token_ids.device).expand_as(self.token_ids)
        return self.parents + 1


@dataclass
class VerifyOutput:
    """The target's verdict, O(K) per row."""

    accept_probs: torch.Tensor  # [B, K] float32: min(1, target/draft) of each draft token (0 past num_draft)
    target_tokens: torch.Tensor  # [B, K+1] int64: recovered token at i < num_draft, bonus at num_draft


@dataclass
class AcceptOutput:
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens
    tokens: torch.Tensor  # [B, K+1] int64: emitted tokens; row b's first num_accepted[b] + 1 are valid
    path: torch.Tensor | None = None  # [B, K] int64 (trees): the accepted nodes, root first; -1 past the path
    depth: torch.Tensor | None = None  # [B] int64 (trees): the drafted tree's depth, the most one pass can accept


def verify(
    target_logits: torch.Tensor,  # [B, K+1, V] float32 logits at the fed positions [pending, d_0..d_{K-1}]
    draft: DraftBlock,
    sampling: SamplingTensors,
    steps: torch.Tensor,  # [B] int64 target-pass counter of each request
) -> VerifyOutput:
    B, K1, V = target_logits.shape
    K = K1 - 1
    assert draft.k == K, f"draft block has K={draft.k}, target logits cover {K} draft positions"
    positions = torch.arange(K, device=target_logits.device)  # [K]
    drafted = positions[None, :] < draft.num_draft[:, None]  # [B, K]
    if sampling.all_greedy:  # fast path: no softmax, no randomness
        argmax = target_logits.argmax(-1)  # [B, K+1]
        expected = argmax[:, :K] if draft.parents is None else argmax.gather(1, draft.parent_positions())
        accept = ((draft.token_ids == expected) & drafted).float()
        return VerifyOutput(accept_probs=accept, target_tokens=argmax)

    target_probs = warp(target_logits, sampling)  # [B, K+1, V]
    draft_dense = _dense_draft_probs(draft, drafted, V)  # [B, K+1, V], zero at i >= num_draft
    if sampling.any_greedy:  # greedy rows: the draft is a point mass at its token, whatever it shipped
        point = torch.zeros_like(draft_dense)
        point[:, :K].scatter_(-1, draft.token_ids[..., None], drafted[..., None].float())
        draft_dense = torch.where((sampling.temperature == 0)[:, None, None], point, draft_dense)

    if draft.parents is not None:
        return _verify_tree(target_probs, draft_dense, draft, drafted, sampling, steps)
    token_index = draft.token_ids[..., None]  # [B, K, 1]
    p_target = target_probs[:, :K].gather(-1, token_index).squeeze(-1)  # [B, K]
    p_draft = draft_dense[:, :K].gather(-1, token_index).squeeze(-1)  # [B, K]
    accept = torch.where(drafted, (p_target / p_draft.clamp_min(1e-30)).clamp_max(1.0), 0.0)

    residual = (target_probs - draft_dense).clamp_min(0.0)  # [B, K+1, V]; = target_probs past num_draft
    empty = residual.sum(-1, keepdim=True) <= 1e-12  # target == draft on its support: never rejected
    residual = torch.where(empty, target_probs, residual)
    u = uniform(sampling.seeds, steps, Stream.TARGET, K1)  # [B, K+1]
    tokens = sample_from_probs(residual.reshape(B * K1, V), u.reshape(B * K1)).view(B, K1)
    return VerifyOutput(accept_probs=accept.float(), target_tokens=tokens)


def accept(
    verified: VerifyOutput,
    draft: DraftBlock,
    seeds: torch.Tensor,  # [B] int64
    steps: torch.Tensor,  # [B] int64
    all_greedy: bool = False,  # every row greedy (SamplingTensors.all_greedy): acceptance is 0 or 1, no uniforms
) -> AcceptOutput:
    B, K = draft.token_ids.shape
    positions = torch.arange(K, device=draft.token_ids.device)  # [K]
    if all_greedy:  # u < p for a u in (0, 1) and p in {0, 1} is p == 1: the same verdict without ~60 hash ops
        ok = verified.accept_probs > 0.5
    else:
        u = uniform(seeds, steps, Stream.ACCEPT, K).to(verified.accept_probs.device)  # [B, K]
        ok = u < verified.accept_probs
    ok = ok & (positions[None, :] < draft.num_draft[:, None])  # [B, K]
    if draft.parents is not None:
        return _walk_tree(ok, verified.target_tokens, draft)
    num_accepted = ok.long().cumprod(-1).sum(-1)  # [B]: length of the accepted prefix
    final = verified.target_tokens.gather(-1, num_accepted[:, None])  # [B, 1] recovered or bonus
    padded = torch.cat([draft.token_ids, final], dim=-1)  # [B, K+1]
    idx = torch.arange(K + 1, device=padded.device)[None, :]
    tokens = torch.where(idx < num_accepted[:, None], padded, final.expand(B, K + 1))
    return AcceptOutput(num_accepted=num_accepted, tokens=tokens)


def _dense_draft_probs(draft: DraftBlock, drafted: torch.Tensor, V: int) -> torch.Tensor:
    """Scatter the sparse draft distribution into [B, K+1, V]; point masses when no probabilities."""
    B, K = draft.token_ids.shape
    dense = torch.zeros(B, K + 1, V, dtype=torch.float32, device=draft.token_ids.device)
    mask = drafted[..., None].float()  # [B, K, 1]
    if draft.top_probs is None:
        dense[:, :K].scatter_(-1, draft.token_ids[..., None], mask)
    else:
        # add, not assign: a support may list an id more than once (padding at probability 0)
        dense[:, :K].scatter_add_(-1, draft.top_ids, draft.top_probs.float() * mask)
    return dense


def _verify_tree(
    target_probs: torch.Tensor,  # [B, K+1, V] warped, at the fed positions [pending, nodes]
    draft_dense: torch.Tensor,  # [B, K+1, V]: node i's draft distribution at i (zero past num_draft)
    draft: DraftBlock,
    drafted: torch.Tensor,  # [B, K] bool
    sampling: SamplingTensors,
    steps: torch.Tensor,
) -> VerifyOutput:
    """Multi-draft rejection sampling over a tree (module docstring): each node's acceptance probability against
    the residual its earlier siblings leave, and per fed position the recovered token drawn from the residual its
    last child leaves (the bonus token from the target where it has no child)."""
    B, K1, V = target_probs.shape
    K = K1 - 1
    parent_pos = draft.parent_positions()  # [B, K]
    node = torch.arange(K, device=parent_pos.device)
    same_parent = (parent_pos[:, :, None] == parent_pos[:, None, :]) & drafted[:, None, :]  # [B, K, K]
    earlier = node[None, :, None] > node[None, None, :]  # [1, K, K]: j < i
    prev_sibling = torch.where(same_parent & earlier, node[None, None, :], -1).amax(-1)  # [B, K], -1: first child
    rank = (same_parent & earlier).sum(-1)  # [B, K]
    draft_nodes = draft_dense[:, :K]  # [B, K, V]
    before = target_probs.gather(1, parent_pos[..., None].expand(B, K, V))  # [B, K, V] residual before each node
    after = torch.zeros_like(before)
    for r in range(int(rank.max()) + 1 if K else 0):  # siblings in order: each sees what the earlier ones left
        prev = after.gather(1, prev_sibling.clamp_min(0)[..., None].expand(B, K, V))
        before = torch.where(((rank == r) & (prev_sibling >= 0))[..., None], prev, before)
        rest = (before - draft_nodes).clamp_min(0.0)
        mass = rest.sum(-1, keepdim=True)
        after = torch.where(mass > 1e-12, rest / mass.clamp_min(1e-30), before)  # empty: never rejected
    token_index = draft.token_ids[..., None]  # [B, K, 1]
    p_target = before.gather(-1, token_index).squeeze(-1)  # [B, K]
    p_draft = draft_nodes.gather(-1, token_index).squeeze(-1)  # [B, K]
    has_mass = draft_nodes.sum(-1) > 0  # a node drawn from nothing (all drawn already) is never accepted
    accept = torch.where(drafted & has_mass, (p_target / p_draft.clamp_min(1e-30)).clamp_max(1.0), 0.0)

    # per fed position: the residual its last child leaves, or the target itself (bonus) where it has none
    is_child = (parent_pos[:, None, :] == torch.arange(K1, device=parent_pos.device)[None, :, None]) & drafted[
        :, None, :]  # [B, K+1, K]
    last_child = torch.where(is_child, node[None, None, :], -1).amax(-1)  # [B, K+1]
    residual = torch.where((last_child >= 0)[..., None],
                           after.gather(1, last_child.clamp_min(0)[..., None].expand(B, K1, V)), target_probs)
    u = uniform(sampling.seeds, steps, Stream.TARGET, K1)  # [B, K+1]
    tokens = sample_from_probs(residual.reshape(B * K1, V), u.reshape(B * K1)).view(B, K1)
    return VerifyOutput(accept_probs=accept.float(), target_tokens=tokens)


def _walk_tree(
    ok: torch.Tensor,  # [B, K] bool: node passed its acceptance test
    target_tokens: torch.Tensor,  # [B, K+1] recovered or bonus token per fed position
    draft: DraftBlock,
) -> AcceptOutput:
    """From the pending token, descend into the first child (in order) that passed its test, until none does;
    then the recovered (or bonus) token of the node the walk stopped at. Without a loop over the nodes: a node is
    on the walk when it and each of its ancestors is the first of its siblings to pass (`tree_ancestors`)."""
    B, K = ok.shape
    device = ok.device
    parent_pos = draft.parent_positions()
    node = torch.arange(K, device=device)
    earlier_sibling = (parent_pos[:, :, None] == parent_pos[:, None, :]) & (node[:, None] > node[None, :])  # [B, K, K]
    first_ok = ok & ~(earlier_sibling & ok[:, None, :]).any(-1)  # [B, K]: the first of its siblings to pass
    ancestors = tree_ancestors(draft.parents)  # [B, K, K]
    on_path = ~(ancestors & ~first_ok[:, None, :]).any(-1)  # [B, K]
    drafted = node[None, :] < draft.num_draft[:, None]  # [B, K]
    depth = torch.where(drafted, ancestors.sum(-1), 0).amax(-1) if K else draft.num_draft  # [B]
    order = torch.where(on_path, node, K).sort(-1).values  # on-path nodes first, parents before children
    path = torch.where(order < K, order, -1)  # [B, K] the walk, then -1
    num_accepted = (path >= 0).sum(-1)  # [B]
    cur = torch.zeros(B, dtype=torch.int64, device=device)  # fed position the walk stops at (0: the pending token)
    if K:
        last = path.gather(1, (num_accepted - 1).clamp_min(0)[:, None]).squeeze(1)  # [B] the deepest accepted node
        cur = torch.where(num_accepted > 0, last + 1, cur)
    final = target_tokens.gather(-1, cur[:, None])  # [B, 1]
    walked = draft.token_ids.gather(-1, path.clamp_min(0))  # [B, K]
    padded = torch.cat([walked, final], dim=-1)  # [B, K+1]
    idx = torch.arange(K + 1, device=device)[None, :]
    tokens = torch.where(idx < num_accepted[:, None], padded, final.expand(B, K + 1))
    return AcceptOutput(num_accepted=num_accepted, tokens=tokens, path=path, depth=depth)
