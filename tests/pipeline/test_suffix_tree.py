"""Suffix decoding's token trees: the frequency tree of a hand-made index, the engine's greedy output with suffix
trees equal to the target's, and statistical exactness of point-mass trees with siblings at T = 0.7 (with negative
controls that must fail), seeded replay."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model
from pipeline.rejection import VerifyOutput, accept, verify
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp
from pipeline.suffix import SEPARATOR, SuffixConfig, SuffixDrafter, SuffixIndex, best_tree, tree_block
from tests.pipeline.test_tree import ALPHA, N, V, _pvalue
from tests.support.models import NoTreeRunner

S = SEPARATOR
# Five occurrences of token 5, most recent first: 5 1 2 3 | 5 8 | 5 1 6 | 5 1 2 4 | 5 1 2 3 (separators end them).
HAND = [5, 1, 2, 3, S, 5, 1, 2, 4, S, 5, 1, 6, S, 5, 8, S, 5, 1, 2, 3, S]


def _hand_tree(budget: int, min_prob: float):
    index = SuffixIndex(max_pattern=4)
    index.extend(HAND)
    return best_tree([(index.tokens, index.ends([5], 64))], budget, min_prob)


def test_the_frequency_tree_of_a_hand_made_index():
    # shares: 1 4/5, 1-2 3/5, 1-2-3 2/5, then 8, 1-6, 1-2-4 1/5 each (ties: the one found first)
    tokens, parents, followed = _hand_tree(8, 0.0)
    assert (tokens, parents) == ([1, 2, 3, 8, 6, 4], [-1, 0, 1, -1, 0, 1])
    assert sorted(e for _, e in followed) == [1, 6, 11, 15, 18]  # every occurrence ends on a leaf
    assert _hand_tree(4, 0.0)[:2] == ([1, 2, 3, 8], [-1, 0, 1, -1])  # the node budget
    assert _hand_tree(8, 0.3)[:2] == ([1, 2, 3], [-1, 0, 1])  # min share 0.3: 2/5 stays, 1/5 goes
    assert _hand_tree(8, 0.5)[:2] == ([1, 2], [-1, 0])
    tokens, parents, followed = _hand_tree(2, 0.0)
    assert (tokens, parents) == ([1, 2], [-1, 0]) and sorted(e for _, e in followed) == [1, 6, 18]
    assert _hand_tree(0, 0.0) == ([], [], [])


def _continuations(tokens: list[int], ends: list[int]) -> dict[tuple[int, ...], int]:
    """Brute force: every continuation prefix of the occurrences and how many occurrences share it."""
    counts: dict[tuple[int, ...], int] = {}
    for e in ends:
        path: tuple[int, ...] = ()
        for t in tokens[e:]:
            if t == SEPARATOR:
                break
            path += (t,)
            counts[path] = counts.get(path, 0) + 1
    return counts


def test_the_tree_takes_the_best_shared_continuations_on_random_sequences():
    """Closed under parents, parents first, distinct siblings, each node's count its share; nothing left out scores
    more than a node kept (best first); with a large budget and no minimum: every continuation."""
    rng = random.Random(0)
    for _ in range(150):
        tokens = [rng.choice([rng.randrange(3), S]) if rng.random() < 0.1 else rng.randrange(3)
                  for _ in range(rng.randrange(2, 40))]
        ends = [e for e in range(len(tokens) - 1, 0, -1) if tokens[e - 1] == tokens[-1]][:64]
        counts = _continuations(tokens, ends)
        budget, min_prob = rng.choice([1, 3, 8, 1000]), rng.choice([0.0, 0.2])
        got, parents, _ = best_tree([(tokens, ends)], budget, min_prob)
        paths: list[tuple[int, ...]] = []
        for t, p in zip(got, parents):
            assert p < len(paths)
            paths.append((paths[p] if p >= 0 else ()) + (t,))
        assert len(set(paths)) == len(paths) <= budget
        kept = {path: counts[path] for path in paths}  # KeyError: not a continuation
        assert all(c >= min_prob * len(ends) for c in kept.values())
        frontier = [c for path, c in counts.items() if path not in kept and path[:-1] in kept | {(): 0}]
        if len(kept) < budget:
            assert all(c < min_prob * len(ends) for c in frontier)
        elif kept and frontier:
            assert min(kept.values()) >= max(frontier)
        if budget == 1000 and min_prob == 0.0:
            assert kept == counts


def test_the_block_ships_trees_and_chains_as_chains():
    block = tree_block([([1, 2, 3, 8], [-1, 0, 1, -1]), ([4], [-1]), ([], [])], 5)
    assert block.parents.tolist() == [[-1, 0, 1, -1, -1], [-1, -1, -1, -1, -1], [-1] * 5]
    assert block.num_draft.tolist() == [4, 1, 0] and block.top_probs is None  # point masses
    assert tree_block([([1, 2], [-1, 0]), ([], [])], 3).parents is None


def test_sampled_rows_draft_trees_from_their_own_context_only():
    d = SuffixDrafter()
    d.draft_trees()
    d.finish("old", [1, 40, 41, 45])
    ctx = [1, 40, 41, 42, 1, 40, 41, 44, 1, 40, 41]
    # the two continuations of [1, 40, 41], the most recent first, then their own continuations: 4 nodes
    assert d.draft_tree("s", ctx, 4, shared=False) == ([44, 42, 1, 1], [-1, -1, 0, 1])
    tokens, parents = d.draft_tree("g", ctx, 4, shared=True)  # a greedy row: the store's occurrence as well
    assert tokens[:3] == [44, 42, 45] and parents[:3] == [-1, -1, -1]


# ---- the engine ----------------------------------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6, 7, 5], [11, 23, 42, 7, 99, 3, 64], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models["llama"])[0]


def _spy(drafter: SuffixDrafter) -> list:
    """Record the blocks the drafter proposes."""
    blocks, propose = [], drafter.propose

    def spied(*args, **kwargs):
        blocks.append(propose(*args, **kwargs))
        return blocks[-1]

    drafter.propose = spied
    return blocks


def test_greedy_output_with_suffix_trees_equals_the_targets(target):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=160)
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [r.token_ids for r in SpeculativeEngine(target, None, None, cfg).generate_batch(PROMPTS, greedy)]
    drafter = SuffixDrafter()
    blocks = _spy(drafter)
    engine = SpeculativeEngine(target, None, drafter, cfg)
    assert drafter.trees
    for k in (3, 8):  # the second round drafts from the store as well
        assert [r.token_ids for r in engine.generate_batch(PROMPTS, greedy, SpecParams(k))] == want
    for prompt, w in zip(PROMPTS, want):
        assert engine.generate(prompt, greedy, SpecParams(6)).token_ids == w
    siblings = [b for b in blocks if b.parents is not None and (b.parents == -1).logical_and(
        torch.arange(b.k) < b.num_draft[:, None]).sum(-1).max() > 1]
    assert siblings, "no tree with siblings under the pending token was drafted"


def test_sampled_suffix_trees_replay_and_do_not_depend_on_the_batch(target):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=160)
    params = [SamplingParams(temperature=0.7, max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    drafter = SuffixDrafter()
    blocks = _spy(drafter)
    engine = SpeculativeEngine(target, None, drafter, cfg)
    singles = [engine.generate(p, q, SpecParams(4)).token_ids for p, q in zip(PROMPTS, params)]
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, params, SpecParams(4))] == singles
    fresh = SpeculativeEngine(target, None, SuffixDrafter(), cfg)  # an empty store: the same outputs
    assert [fresh.generate(p, q, SpecParams(4)).token_ids for p, q in zip(PROMPTS, params)] == singles
    assert any(b.parents is not None for b in blocks)


def test_chains_where_the_target_has_no_tree_attention_or_the_config_says_so(target, caplog):
    with caplog.at_level("INFO"):
        engine = SpeculativeEngine(NoTreeRunner(target), None, SuffixDrafter(), EngineConfig(max_seq_len=128))
    assert not engine.drafter.trees and "drafting chains" in caplog.text
    assert not SpeculativeEngine(target, None, SuffixDrafter(SuffixConfig(tree=False))).drafter.trees
    want = SpeculativeEngine(target, None, None).generate(PROMPTS[0], SamplingParams(max_tokens=16)).token_ids
    assert engine.generate(PROMPTS[0], SamplingParams(max_tokens=16), SpecParams(4)).token_ids == want


# ---- statistical exactness of point-mass trees with siblings ---------------------------------------------------------
# A context-free target: a fixed distribution per fed position (pending, then each node). The draft is a suffix tree
# of a hand-made context (point masses, no probabilities shipped), with siblings under the pending token and deeper.

CONTEXT = [0, 1, 2, 0, 3, 4, 0, 1, 5, 0, 1, 2, 0, 3, 6, 0]  # after 0: 1 (3x: then 2 twice, 5 once), 3 (2x)


def _suffix_passes(broken: str | None = None, seed: int = 13):
    d = SuffixDrafter(SuffixConfig(alpha=8.0))
    tokens, parents = d.draft_tree("r", CONTEXT, 6, shared=False)
    assert sum(p == -1 for p in parents) > 1 and len(tokens) >= 4  # siblings at the root
    K = len(tokens)
    block = tree_block([(tokens, parents)] * N, K)
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(K + 1, V, generator=g)
    for n, p in enumerate(parents):  # the drafted tokens likely, so that later siblings get accepted too
        target_logits[p + 1, tokens[n]] += 1.0
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + seed
    steps = torch.full((N,), 3, dtype=torch.int64)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.7, seed=int(s)) for s in seeds])
    target = warp(target_logits[None], sampling.select([0]))[0]  # [K+1, V] what the output must follow
    logits = target_logits.expand(N, K + 1, V).clone()
    verified = verify(logits, block, sampling, steps)
    if broken == "siblings_against_the_target":  # each sibling tested against the target, not the residual
        at_parent = target[torch.tensor(parents) + 1].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)  # [K]
        verified = dataclasses.replace(verified, accept_probs=at_parent.expand(N, K).clone())
    elif broken == "recover_from_target":  # the recovered token ignores what the siblings took away
        tgt = target.expand(N, K + 1, V).reshape(-1, V)
        drawn = sample_from_probs(tgt, uniform(seeds, steps, Stream.TARGET, K + 1).reshape(-1))
        verified = VerifyOutput(verified.accept_probs, drawn.view(N, K + 1))
    return accept(verified, block, seeds, steps), target, parents


def _pvalues(out, target, parents: list[int]) -> dict[str, float]:
    K = len(parents)
    pv = {"pending": _pvalue(out.tokens[:, 0], target[0])}
    for n in range(K):
        for depth in range(K):
            reached = out.path[:, depth] == n
            if reached.sum() >= 2000:
                pv[f"node {n}"] = _pvalue(out.tokens[reached, depth + 1], target[n + 1])
    return pv


def test_point_mass_trees_follow_the_target():
    out, target, parents = _suffix_passes()
    pv = _pvalues(out, target, parents)
    assert len(pv) >= 3, f"too few nodes reached to test: {pv}"
    assert min(pv.values()) > ALPHA, f"deviates from the target: {pv}"
    later = [n for n, p in enumerate(parents) if p == -1][1:]  # the root's later siblings
    assert (out.path[:, :1] == torch.tensor(later)).any(-1).float().mean() > 0.02
    assert 0.05 < (out.num_accepted == 0).float().mean() < 0.95


@pytest.mark.parametrize("broken", ["siblings_against_the_target", "recover_from_target"])
def test_negative_controls_fail_the_point_mass_tree_test(broken):
    out, target, parents = _suffix_passes(broken)
    pv = _pvalues(out, target, parents)
    assert min(pv.values()) < 1e-6, f"a broken sampler passed the point-mass tree test: {pv}"


def test_point_mass_trees_replay_by_seed():
    first, _, _ = _suffix_passes()
    again, _, _ = _suffix_passes()
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.path, again.path)
    other, _, _ = _suffix_passes(seed=14)
    assert not torch.equal(first.tokens, other.tokens)
