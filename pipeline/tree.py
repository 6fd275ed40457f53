"""Token-tree drafts (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024): a draft model proposes a tree of a
static shape, the target verifies every node in one pass with a tree attention mask
(`pipeline.models.tree_attention`), and `pipeline.rejection` accepts one root-to-node path exactly.

The shape (`TreeShape`, from a `TreeConfig`): every node at depth d gets branching[d] children; with a node budget
the nodes whose sibling ranks along their path add up least are kept (rank 0: the draft's favourite), which keeps
the tree closed under parents and each node's kept children a run of ranks 0..c-1. Or the config's explicit rank
paths (`TreeConfig.paths`: a tree of `specserve tune-tree`, `pipeline.tree_tune`). Nodes are numbered breadth
first, children in rank order, so a node's parent precedes it and the first n nodes of a level-truncated tree are
a tree too.

Drafting (`TreeDrafter`): the draft model drafts level by level, one forward per level over that level's nodes.
A greedy row's children are the draft's c most likely tokens; a sampled row's are drawn without replacement from
the warped draft distribution (Sequoia), each shipping the distribution it was drawn from given its earlier
siblings (the draft renormalised over the tokens not yet drawn), which is what the multi-draft rejection sampler
needs to stay exact. A sibling that finds nothing left to draw ships an empty distribution and is never accepted.
`draw_children` draws a level's tokens so for every tree drafter: `TreeDrafter` and the feature heads
(`pipeline.heads.drafter`: `HeadDrafter.draft_trees`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.config import TreeConfig
from pipeline.drafters import ModelDrafter, ProposeRow, _as_list
from pipeline.models.tree_attention import TreeMask
from pipeline.rejection import DraftBlock
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TreeShape:
    """A static tree, nodes breadth first."""

    parents: tuple[int, ...]  # parent node of each node, -1: the pending token
    ranks: tuple[int, ...]  # each node's rank among its siblings (0: the draft's favourite)
    depths: tuple[int, ...]  # 0 for the pending token's children

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths) + 1

    def nodes_within(self, depth: int) -> int:
        """How many nodes have depth < `depth` (they come first)."""
        return sum(1 for d in self.depths if d < depth)

    @staticmethod
    def chain(k: int) -> "TreeShape":
        return TreeShape(tuple(range(-1, k - 1)), (0,) * k, tuple(range(k)))


def tree_shape(config: TreeConfig) -> TreeShape:
    """The nodes of `config`'s tree (module docstring; its explicit `paths` where given), breadth first."""
    paths: list[tuple[int, ...]] = list(config.paths or ())  # each node as its path of sibling ranks
    level = [()]
    for b in config.branching if config.paths is None else ():
        level = [p + (r,) for p in level for r in range(b)]
        paths += level
    if config.max_nodes is not None:  # a parent sorts before its children: the kept set is closed under parents
        paths = sorted(paths, key=lambda p: (sum(p), len(p), p))[: config.max_nodes]
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    return TreeShape(tuple(index.get(p[:-1], -1) for p in paths), tuple(p[-1] for p in paths),
                     tuple(len(p) - 1 for p in paths))


def supports_tree(model: object) -> bool:
    """Whether a runner verifies trees (the eager fast path and the CUDA graph path do; tensor parallelism and the
    generic runner do not)."""
    return bool(getattr(model, "supports_tree", False))


class TreeDrafter:
    """A draft model drafting `TreeShape` trees (module docstring). A row's tree is cut to its draft budget's
    depth (the request's K, never past max_tokens)."""

    def __init__(self, drafter: ModelDrafter, config: TreeConfig) -> None:
        if not supports_tree(drafter.model):
            raise ValueError(f"draft model {drafter.name} runs on a path without tree attention (tensor parallel or "
                             "the generic runner?)")
        self.drafter, self.config = drafter, config
        self.shape = tree_shape(config)
        self.name = f"{drafter.name} (tree {'x'.join(map(str, config.branching))}, {self.shape.num_nodes} nodes)"

    @property
    def model(self):
        return self.drafter.model

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        self.drafter.admit(request_id, context)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)

    @torch.inference_mode()
    def propose(self, rows: Sequence[ProposeRow], k: int, sampling: SamplingTensors, steps: torch.Tensor,
                draft_top_k: int) -> DraftBlock:
        shape, d = self.shape, self.drafter
        B, N = len(rows), shape.num_nodes
        caps = [min(r.num_draft, shape.depth) for r in rows]
        depth = max(caps)
        logits, slots, positions = d.feed_context(rows)  # [B, 1, V'] after the pending token
        device = logits.device
        parents = torch.tensor(shape.parents, dtype=torch.int64, device=device).expand(B, N).contiguous()
        tokens = torch.zeros(B, N, dtype=torch.int64, device=device)
        top_ids = torch.zeros(B, N, draft_top_k, dtype=torch.int64, device=device)
        top_probs = torch.zeros(B, N, draft_top_k, dtype=torch.float32, device=device)
        u = uniform(sampling.seeds, steps, Stream.DRAFT, N).to(device)  # [B, N]: node n draws with u[:, n]
        greedy = (sampling.temperature == 0)[:, None]  # [B, 1]
        level_nodes = [-1]  # the nodes whose children the next level holds; logits[:, i] are level_nodes[i]'s
        fed = 0
        for level in range(depth):
            lo, hi = shape.nodes_within(level), shape.nodes_within(level + 1)
            draw_children(shape, logits, level_nodes, range(lo, hi), sampling, u, greedy, tokens, top_ids, top_probs,
                          d._out_ids)
            if level + 1 < depth:  # the next level needs this one's logits
                tree = TreeMask(parents[:, :hi], first=lo)
                logits = d.model.forward(tokens[:, lo:hi], positions + lo, slots, tree=tree)  # [B, hi-lo, V']
                level_nodes, fed = list(range(lo, hi)), hi
        # The draft cache holds the context, then this tree; node 0 sits where a chain's first token would.
        first = tokens[:, 0].tolist() if fed else [None] * B
        for b, r in enumerate(rows):
            d._fed[r.request_id] = _as_list(r.context) + ([first[b]] if fed else [])
        num_draft = torch.tensor([shape.nodes_within(c) for c in caps], dtype=torch.int64, device=device)
        return DraftBlock(tokens, num_draft, top_ids, top_probs, parents)


def draw_children(
    shape: TreeShape,
    logits: torch.Tensor,  # [B, P, V'] the drafter's logits at the parents
    parent_nodes: list[int],  # [P] node of each (-1: the pending token)
    nodes: range,  # this level's nodes (children of parent_nodes, breadth first)
    sampling: SamplingTensors,
    u: torch.Tensor,  # [B, N] float64 DRAFT uniforms: node n draws with u[:, n]
    greedy: torch.Tensor,  # [B, 1] bool
    tokens: torch.Tensor,  # [B, N] out
    top_ids: torch.Tensor,  # [B, N, k] out
    top_probs: torch.Tensor,  # [B, N, k] out
    out_ids: torch.Tensor | None = None,  # [V'] target id of each logit (a reduced draft vocabulary); None: itself
) -> None:
    """Draw one level's tokens, each node shipping the distribution it was drawn from: a greedy row's children are
    its c most likely tokens (point masses); a sampled row's are c draws without replacement from the warped
    top-k distribution (`draw_without_replacement`), the drafter (`TreeDrafter`, `pipeline.heads.drafter`) of
    every token tree."""
    k = top_ids.shape[-1]
    probs = warp(logits, sampling)  # [B, P, V']
    kk = min(k, probs.shape[-1])
    sparse_probs, sparse_idx = probs.topk(kk, dim=-1)  # [B, P, kk]
    sparse_probs = sparse_probs / sparse_probs.sum(-1, keepdim=True)
    most = max(shape.ranks[n] for n in nodes) + 1
    best_idx = logits.topk(min(most, logits.shape[-1]), dim=-1).indices  # [B, P, c] greedy rows' children
    as_token = (lambda i: i) if out_ids is None else (lambda i: out_ids.to(i.device)[i])  # noqa: E731
    sparse_ids = as_token(sparse_idx)
    drawn = torch.zeros_like(sparse_probs, dtype=torch.bool)  # [B, P, kk] drawn by an earlier sibling
    for n in nodes:  # rank order within each parent
        p = parent_nodes.index(shape.parents[n])
        choice, q, drawn[:, p] = draw_without_replacement(sparse_probs[:, p], drawn[:, p], u[:, n])
        sampled_token = sparse_ids[:, p].gather(-1, choice[:, None]).squeeze(-1)
        rank = min(shape.ranks[n], best_idx.shape[-1] - 1)
        greedy_token = as_token(best_idx[:, p, rank])
        token = torch.where(greedy[:, 0], greedy_token, sampled_token)
        tokens[:, n] = token
        point = torch.zeros(tokens.shape[0], kk, device=q.device)
        point[:, 0] = 1.0
        top_ids[:, n, :kk] = torch.where(greedy, token[:, None].expand(-1, kk), sparse_ids[:, p])
        top_probs[:, n, :kk] = torch.where(greedy, point, q)
        if kk < k:
            top_ids[:, n, kk:] = top_ids[:, n, :1]  # padding: a repeated id at probability 0


def draw_without_replacement(
    probs: torch.Tensor,  # [B, k] a distribution (rows sum to 1)
    drawn: torch.Tensor,  # [B, k] bool: entries drawn by earlier siblings
    u: torch.Tensor,  # [B] float64 uniforms
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One more sibling, drawn from `probs` renormalised over the entries not yet drawn -> (the entry drawn [B], the
    distribution it was drawn from [B, k] (all zero where nothing was left: that sibling is void), drawn [B, k])."""
    left = torch.where(drawn, 0.0, probs)
    mass = left.sum(-1, keepdim=True)  # [B, 1]
    q = torch.where(mass > 0, left / mass.clamp_min(1e-30), 0.0)
    choice = sample_from_probs(torch.where(mass > 0, q, probs), u)  # [B]
    drawn = drawn | (torch.nn.functional.one_hot(choice, probs.shape[-1]).bool() & (mass > 0))
    return choice, q, drawn
