"""The step's pieces (pipeline.step) on literal cases: the draft budget rule, packing rows' drafts, and a target pass
whose verdicts are what verify + accept give."""

from __future__ import annotations

import torch

from pipeline.adaptive import AdaptiveK
from pipeline.config import SamplingParams
from pipeline.rejection import accept, verify
from pipeline.sampling import SamplingTensors
from pipeline.sequence import RequestState
from pipeline.step import Draft, empty_block, new_k_policy, pack, verify_and_accept


def _state(rid: str, temperature: float, max_tokens: int, generated: int = 0) -> RequestState:
    s = RequestState(rid, [1, 2, 3], SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1))
    s.output_ids = [4] * generated
    return s


def test_budget_is_the_requests_k_never_past_max_tokens_and_the_policy_sets_greedy_rows_only():
    from pipeline.step import draft_budgets

    rows = [_state("g", 0.0, 10), _state("s", 0.8, 10), _state("end", 0.0, 10, generated=8), _state("last", 0.8, 1)]
    assert draft_budgets(rows, 4) == ([4, 4, 1, 0], False)

    class Fixed(AdaptiveK):
        def choose(self, batch: int, cap: int | None = None) -> int:
            self.asked = (batch, cap)
            return 2

    policy = Fixed(max_k=64)
    assert draft_budgets(rows, 4, policy, batch=7) == ([2, 4, 1, 0], True)  # sampled rows keep K (replay)
    assert policy.asked == (7, 4)
    sampled_only = [_state("s", 0.8, 10)]
    assert draft_budgets(sampled_only, 4, policy) == ([4], False)  # no greedy row: the policy is not asked
    assert new_k_policy().max_k == 64


def test_pack_stacks_rows_of_any_length():
    block = pack([Draft([5, 6, 7]), Draft([]), Draft([9])])
    assert block.token_ids.tolist() == [[5, 6, 7], [0, 0, 0], [9, 0, 0]] and block.num_draft.tolist() == [3, 0, 1]
    assert block.top_ids is None  # every row a point mass: the verifier treats them so without a support
    assert pack([Draft([]), Draft([])]).k == 0


def test_verdicts_are_verify_then_accept():
    torch.manual_seed(0)
    V, B = 16, 3

    class Target:  # fixed logits for whatever is fed
        def forward(self, tokens, positions, slots):
            g = torch.Generator().manual_seed(int(tokens.sum()))
            return torch.randn(tokens.shape[0], tokens.shape[1], V, generator=g)

    params = [SamplingParams(temperature=t, seed=s) for t, s in ((0.0, 1), (1.0, 2), (0.7, 3))]
    sampling = SamplingTensors.from_params(params)
    steps = torch.tensor([0, 5, 9])
    draft = pack([Draft([3, 4]), Draft([7, 7]), Draft([1])])
    pending = torch.tensor([2, 8, 11])
    verdicts = verify_and_accept(Target(), pending, draft, torch.zeros(B, dtype=torch.int64), torch.arange(B),
                                 sampling, steps)
    logits = Target().forward(torch.cat([pending[:, None], draft.token_ids], 1), None, None)
    out = accept(verify(logits, draft, sampling, steps), draft, sampling.seeds, steps)
    for b, v in enumerate(verdicts):
        n = int(out.num_accepted[b])
        assert (v.num_draft, v.num_accepted, v.tokens) == (int(draft.num_draft[b]), n, out.tokens[b, : n + 1].tolist())
    none = verify_and_accept(Target(), pending, empty_block(B, "cpu"), torch.zeros(B, dtype=torch.int64),
                             torch.arange(B), sampling, steps)
    assert [(v.num_draft, v.num_accepted, len(v.tokens)) for v in none] == [(0, 0, 1)] * B
