"""Rejection sampler: literal greedy tables, statistical exactness (with negative controls), determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from pipeline.config import SamplingParams
from pipeline.rejection import DraftBlock, VerifyOutput, accept, verify
from pipeline.rng import Stream, uniform
from pipeline.sampling import SamplingTensors, sample_from_probs, warp

V = 8


def _greedy_logits(argmaxes: list[list[int]]) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at each position is the given token."""
    B, K1 = len(argmaxes), len(argmaxes[0])
    logits = torch.zeros(B, K1, V)
    for b, row in enumerate(argmaxes):
        for i, tok in enumerate(row):
            logits[b, i, tok] = 5.0
    return logits


# (draft tokens, num_draft, target argmaxes at K+1 positions) -> expected emitted tokens
GREEDY_TABLE = [
    ([1, 2, 3], 3, [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + bonus
    ([1, 2, 3], 3, [1, 5, 3, 4], [1, 5]),  # rejected at 1 -> recovered 5
    ([1, 2, 3], 3, [7, 2, 3, 4], [7]),  # rejected at 0
    ([1, 2, 3], 2, [1, 2, 6, 4], [1, 2, 6]),  # only 2 drafted: bonus at position 2
    ([1, 2, 3], 0, [0, 2, 3, 4], [0]),  # nothing drafted: plain decode
    ([3, 3, 3], 3, [3, 3, 3, 3], [3, 3, 3, 3]),
]


@pytest.mark.parametrize("draft_tokens,num_draft,argmaxes,expected", GREEDY_TABLE)
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("fast", [False, True], ids=["uniforms", "all-greedy-flag"])
def test_greedy_literal_table(draft_tokens, num_draft, argmaxes, expected, with_probs, fast):
    K = len(draft_tokens)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=0.0, seed=0)])
    top = (dict(top_ids=torch.arange(V).expand(1, K, V).clone(), top_probs=torch.full((1, K, V), 1.0 / V))
           if with_probs else {})
    draft = DraftBlock(torch.tensor([draft_tokens]), torch.tensor([num_draft]), **top)
    steps = torch.zeros(1, dtype=torch.int64)
    out = accept(verify(_greedy_logits([argmaxes]), draft, sampling, steps), draft, sampling.seeds, steps,
                 all_greedy=fast)
    n = int(out.num_accepted[0])
    assert out.tokens[0, : n + 1].tolist() == expected


def test_greedy_batch_mixed_rows():
    rows = GREEDY_TABLE[:4]
    sampling = SamplingTensors.from_params([SamplingParams(seed=i) for i in range(len(rows))])
    draft = DraftBlock(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))
    steps = torch.zeros(len(rows), dtype=torch.int64)
    out = accept(verify(_greedy_logits([r[2] for r in rows]), draft, sampling, steps), draft, sampling.seeds, steps)
    for b, r in enumerate(rows):
        n = int(out.num_accepted[b])
        assert out.tokens[b, : n + 1].tolist() == r[3]


# --------------------------------------------------------------------------------------------------
# Statistical exactness. A "context-free" target: fixed distributions per position, so a correct sampler
# emits, at output index i of a pass, a token distributed exactly as target_probs[i] (given it exists).


def _speculative_passes(
    target_probs: torch.Tensor,  # [K+1, V]
    draft_probs: torch.Tensor,  # [K, V]
    n: int,
    draft_top_k: int | None = None,
    temperature: float = 1.0,
    broken: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    K = draft_probs.shape[0]
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    steps = torch.full((n,), 3, dtype=torch.int64)
    params = [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds]
    sampling = SamplingTensors.from_params(params)
    # The drafter: sample each position from its (optionally top-k truncated) distribution.
    q = draft_probs.expand(n, K, V).clone()
    if draft_top_k is not None:
        top_probs, top_ids = q.topk(draft_top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
    else:
        top_probs, top_ids = q, torch.arange(V).expand(n, K, V).clone()
    u = uniform(seeds, steps, Stream.DRAFT, K)  # [n, K]
    choice = sample_from_probs(top_probs.reshape(n * K, -1), u.reshape(-1)).view(n, K)
    draft_tokens = top_ids.gather(-1, choice[..., None]).squeeze(-1)
    draft = DraftBlock(draft_tokens, torch.full((n,), K), top_ids, top_probs)
    logits = target_probs.log().expand(n, K + 1, V) * temperature  # warp(logits / T) == target_probs
    verified = verify(logits, draft, sampling, steps)
    if broken == "accept_always":
        verified = dataclasses.replace(verified, accept_probs=torch.ones_like(verified.accept_probs))
    elif broken == "recover_from_target":  # forgets to subtract the draft from the residual
        tgt = target_probs.expand(n, K + 1, V).reshape(-1, V)
        tokens = sample_from_probs(tgt, uniform(seeds, steps, Stream.TARGET, K + 1).reshape(-1)).view(n, K + 1)
        verified = VerifyOutput(verified.accept_probs, tokens)
    out = accept(verified, draft, seeds, steps)
    return out.tokens, out.num_accepted


def _random_dists(seed: int, K: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)
    draft = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    return target, draft


def _pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    keep = probs > 0
    expected = probs.double() * counts.sum() / probs.double()[keep].sum()
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = expected[keep].numpy()
    return float(chisquare(counts[keep].numpy(), exp * counts.sum().item() / exp.sum()).pvalue)


# Power: with n = 40k, a bias of 0.01 in total variation on V=8 gives a chi-square p-value far below 1e-4,
# while a correct sampler fails a 1e-4 threshold once in 10,000 runs. Both controls below are that biased.
N = 40_000
ALPHA = 1e-4


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("draft_top_k", [None, 3])
def test_output_follows_target_distribution(seed, draft_top_k):
    K = 3
    target, draft = _random_dists(seed, K)
    tokens, num_accepted = _speculative_passes(target, draft, N, draft_top_k=draft_top_k)
    for i in range(K + 1):
        present = num_accepted >= i  # output index i exists iff i drafts were accepted
        assert _pvalue(tokens[present, i], target[i]) > ALPHA, f"position {i} deviates from the target"
    # It is real speculation: drafts were accepted often, and rejections happened too.
    assert 0.05 < num_accepted.float().mean() / K < 0.95


@pytest.mark.parametrize("broken", ["accept_always", "recover_from_target"])
def test_negative_controls_fail_the_same_test(broken):
    K = 3
    target, draft = _random_dists(0, K)
    tokens, num_accepted = _speculative_passes(target, draft, N, broken=broken)
    pvalues = [_pvalue(tokens[num_accepted >= i, i], target[i]) for i in range(K)]
    assert min(pvalues) < 1e-6, f"a broken sampler passed the exactness test: {pvalues}"


def test_point_mass_drafts_without_probabilities():
    """Prompt-lookup drafts carry no probabilities: treated as point masses, still exact."""
    K, n = 2, N
    target, _ = _random_dists(5, K)
    seeds = torch.arange(n, dtype=torch.int64)
    steps = torch.zeros(n, dtype=torch.int64)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=int(s)) for s in seeds])
    draft = DraftBlock(torch.tensor([[2, 5]]).expand(n, K).clone(), torch.full((n,), K))
    out = accept(verify(target.log().expand(n, K + 1, V), draft, sampling, steps), draft, seeds, steps)
    assert _pvalue(out.tokens[:, 0], target[0]) > ALPHA
    assert _pvalue(out.tokens[out.num_accepted >= 1, 1], target[1]) > ALPHA


def test_warped_target_distribution_with_top_k_top_p():
    """With top-k/top-p the output must follow the *warped* target (what plain sampling would give)."""
    K = 2
    target, draft = _random_dists(3, K)
    n = N
    seeds = torch.arange(n, dtype=torch.int64) + 100
    steps = torch.ones(n, dtype=torch.int64)
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=int(s)) for s in seeds]
    sampling = SamplingTensors.from_params(params)
    logits = target.log()[None]  # [1, K+1, V]
    warped_target = warp(logits, sampling.select([0]))[0]  # [K+1, V]
    warped_draft = warp(draft.log()[None], sampling.select([0]))[0]  # [K, V]
    u = uniform(seeds, steps, Stream.DRAFT, K)
    d = sample_from_probs(warped_draft.expand(n, K, V).reshape(-1, V), u.reshape(-1)).view(n, K)
    block = DraftBlock(d, torch.full((n,), K), torch.arange(V).expand(n, K, V).clone(),
                       warped_draft.expand(n, K, V).clone())
    out = accept(verify(logits.expand(n, K + 1, V), block, sampling, steps), block, seeds, steps)
    assert (warped_target[0] == 0).sum() >= 3, "the warp should have removed tokens"
    assert _pvalue(out.tokens[:, 0], warped_target[0]) > ALPHA
    assert _pvalue(out.tokens[out.num_accepted >= 1, 1], warped_target[1]) > ALPHA


def test_seeded_determinism_and_batch_invariance():
    K = 3
    target, draft = _random_dists(7, K)
    a, na = _speculative_passes(target, draft, 64)
    b, nb = _speculative_passes(target, draft, 64)
    assert torch.equal(a, b) and torch.equal(na, nb)
    # Row r of a batch equals the same request run alone (randomness keyed by seed and step only).
    single, nsingle = _speculative_passes(target, draft, 1)
    assert torch.equal(single[0, : int(nsingle[0]) + 1], a[0, : int(na[0]) + 1])


def test_uniforms_are_keyed_and_uniform():
    seeds = torch.tensor([1, 1, 2], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0], dtype=torch.int64)
    u = uniform(seeds, steps, Stream.ACCEPT, 4)
    assert u.shape == (3, 4) and (u > 0).all() and (u < 1).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u, uniform(seeds, steps, Stream.TARGET, 4))
    assert torch.equal(u, uniform(seeds, steps, Stream.ACCEPT, 4))
    many = uniform(torch.arange(20000, dtype=torch.int64), torch.zeros(20000, dtype=torch.int64), Stream.DRAFT, 3)
    hist = torch.histc(many.float(), bins=10, min=0, max=1)
    assert chisquare(hist.numpy()).pvalue > ALPHA


def test_sample_from_probs_skips_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(1000, 5)
    u = uniform(torch.arange(1000, dtype=torch.int64), torch.zeros(1000, dtype=torch.int64), Stream.TARGET, 1)[:, 0]
    drawn = sample_from_probs(probs, u)
    assert set(drawn.tolist()) == {1, 3}


def test_top_p_keeps_smallest_prefix():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])  # probs ~ .64 .24 .09 .03
    s = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_p=0.8, seed=0)])
    probs = warp(logits, s)[0, 0]
    assert (probs > 0).tolist() == [True, True, False, False]
    s = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=1, seed=0)])
    assert warp(logits, s)[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_support_listing_an_id_twice_adds_up():
    """Sparse draft supports may repeat an id (padding at probability 0, or a point mass spread over copies):
    the dense draft distribution adds the entries of an id, so padding never changes it."""
    from pipeline.rejection import _dense_draft_probs

    ids = torch.tensor([[[3, 1, 3, 3]]])  # [B=1, K=1, k=4]
    probs = torch.tensor([[[0.6, 0.4, 0.0, 0.0]]])
    block = DraftBlock(torch.tensor([[3]]), torch.tensor([1]), ids, probs)
    dense = _dense_draft_probs(block, torch.tensor([[True]]), V)
    want = torch.zeros(V)
    want[3], want[1] = 0.6, 0.4
    torch.testing.assert_close(dense[0, 0], want)
    assert dense[0, 1].sum() == 0  # the bonus position has no draft


def test_select_keeps_the_greedy_flags():
    mixed = SamplingTensors.from_params([SamplingParams(seed=1), SamplingParams(temperature=0.7, seed=2),
                                         SamplingParams(seed=3)])
    assert (mixed.select([0, 2]).all_greedy, mixed.select([0, 2]).any_greedy) == (True, True)
    assert (mixed.select([1]).all_greedy, mixed.select([1]).any_greedy) == (False, False)
    assert (mixed.select([1, 2]).all_greedy, mixed.select([1, 2]).any_greedy) == (False, True)
    greedy = SamplingTensors.from_params([SamplingParams(seed=s) for s in range(3)])
    assert greedy.select([2]).all_greedy and greedy.select([2]).seeds.tolist() == [2]
    sampled = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=s) for s in range(3)])
    assert not sampled.select([0, 1]).any_greedy
