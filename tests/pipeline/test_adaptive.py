"""The per-step K policy: literal values of the pure functions, and a simulated server whose target turns
compute-bound under load, where speculation must switch itself off (and stay on where it pays)."""

from __future__ import annotations

import random

import pytest

from pipeline.adaptive import (
    AdaptiveK,
    acceptance_rate,
    batch_bucket,
    best_k,
    default_candidates,
    expected_tokens,
    interpolate_costs,
)


@pytest.mark.parametrize(
    "alpha, k, want",
    [(0.0, 0, 1.0), (0.0, 4, 1.0), (0.5, 0, 1.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (0.8, 4, 3.3616), (1.0, 4, 5.0)],
)
def test_expected_tokens(alpha, k, want):
    assert expected_tokens(alpha, k) == pytest.approx(want)


def test_acceptance_rate_and_buckets():
    assert acceptance_rate(0, 0) == 0.5  # the Beta(1, 1) prior
    assert acceptance_rate(8, 2) == pytest.approx(9 / 12)
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert default_candidates(4) == (0, 1, 2, 3, 4)
    assert default_candidates(9) == (0, 1, 2, 3, 4, 6, 8, 9)


def test_best_k_prefers_no_speculation_when_verifying_costs_more():
    flat = {0: 1.0, 1: 1.0, 2: 1.0, 4: 1.05}  # memory-bound: verifying 5 tokens ~ decoding 1
    assert best_k(0.7, flat) == 4
    assert best_k(0.0, flat) == 0  # nothing is ever accepted: drafting is pure cost
    steep = {0: 1.0, 1: 1.9, 2: 2.8, 4: 4.6}  # compute-bound: cost grows with the tokens verified
    assert best_k(0.7, steep) == 0
    assert best_k(0.5, {0: 1.0, 2: 1.75}) == 0  # a tie (1.75 / 1.75) goes to the smaller K


def test_interpolate_costs():
    got = interpolate_costs({0: 1.0, 1: 1.5, 4: 2.0}, [0, 1, 2, 3, 4, 6])
    assert got == pytest.approx({0: 1.0, 1: 1.5, 2: 1.5 + 0.5 / 3, 3: 1.5 + 1.0 / 3, 4: 2.0, 6: 2.0 + 2 * 0.5 / 3})
    assert interpolate_costs({1: 2.0}, [0, 1, 3]) == {0: 2.0, 1: 2.0, 3: 2.0}
    assert interpolate_costs({0: 2.0, 1: 1.0}, [4]) == {4: 1.0}  # never a negative slope


def _simulate(policy: AdaptiveK | None, k_fixed: int, batch: int, alpha: float, steps: int = 600) -> float:
    """Tokens per second of a simulated server: a roofline target (memory floor 1.0, then linear in the
    tokens verified per pass) plus a drafter costing 0.05 per drafted token."""
    rng = random.Random(0)
    tokens = seconds = 0.0
    for _ in range(steps):
        k = policy.choose(batch, 4) if policy else k_fixed
        cost = max(1.0, batch * (k + 1) / 24) + 0.05 * k
        accepted = []
        for _ in range(batch):
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            accepted.append(n)
        tokens += sum(a + 1 for a in accepted)
        seconds += cost
        if policy:
            policy.observe(batch, k, cost, [k] * batch, accepted)
    return tokens / seconds


@pytest.mark.parametrize("batch, alpha", [(1, 0.8), (4, 0.6), (32, 0.8), (64, 0.5), (1, 0.05)])
def test_policy_is_never_worse_than_no_speculation(batch, alpha):
    policy = AdaptiveK(max_k=4)
    on = _simulate(policy, 0, batch, alpha)
    off = _simulate(None, 0, batch, alpha)
    best_fixed = max(_simulate(None, k, batch, alpha) for k in range(5))
    assert on >= 0.99 * off  # the exploration steps are the only loss
    assert on >= 0.95 * best_fixed
    if batch >= 32:
        assert policy.choose(batch, 4) == 0 or policy.steps % policy.explore_every == 0
    if batch == 1 and alpha > 0.5:
        assert on > 1.8 * off


def test_policy_follows_a_change_in_acceptance():
    policy = AdaptiveK(max_k=4, explore_every=16)
    _simulate(policy, 0, 1, 0.9, steps=200)
    assert policy.choose(1, 4) == 4
    _simulate(policy, 0, 1, 0.0, steps=600)  # the drafter stops agreeing with the target
    assert policy.alpha < 0.2
    assert policy.choose(1, 4) == 0


def test_first_step_of_a_shape_is_not_taken_as_its_cost():
    """The first step at a new (batch, K) pays graph capture and compilation: it must not stick as that K's
    cost (seen on the GPU: one 45 ms capture step kept K=1 'measured' at 6x its real cost)."""
    policy = AdaptiveK(max_k=4)
    for _ in range(40):
        k = policy.choose(1, 4)
        first = (1, k) not in policy._warm
        cost = (50.0 if first else 1.0) + 0.01 * k  # verifying K+1 tokens costs about one decode step
        policy.observe(1, k, cost, [k], [k])  # everything accepted
    assert max(policy.costs(1).values()) < 2.0
    assert policy.choose(1, 4) == 4


def test_steps_that_captured_a_graph_are_not_taken_as_costs():
    """Later captures (a row's context crossing into a new key bucket) come at any step, not only the first of
    a shape: the engine marks those steps untimed and the policy keeps their acceptance but not their time."""
    policy = AdaptiveK(max_k=4)
    for i in range(200):
        k = policy.choose(32, 4)
        capture = i % 7 == 3  # a capture now and then, at whatever K runs
        policy.observe(32, k, (40.0 if capture else 1.0) + 0.01 * k, [k] * 32, [k] * 32, timed=not capture)
    assert max(policy.costs(32).values()) < 1.1
    assert policy.choose(32, 4) == 4
    assert policy.alpha > 0.9  # acceptance was still counted on the untimed steps


def test_engine_marks_capturing_steps_untimed(tiny_models):
    """SpeculativeEngine passes timed=False exactly for the steps during which the target captured a graph."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import PromptLookupDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    class Recorder(AdaptiveK):
        def observe(self, *args, timed=True):
            self.flags.append(timed)
            super().observe(*args, timed=timed)

    target, _ = load_model(tiny_models["llama"])

    class Stats:
        captures = 0

    target.stats = Stats()  # an eager runner standing in for a graph runner's counter
    forward = target.forward

    def capturing(tokens, positions, slots, logits_from=0):
        if tokens.shape[1] > 1 and positions.numel() == 1:
            target.stats.captures += 1  # pretend every verify-shaped call captured
        return forward(tokens, positions, slots, logits_from)

    target.forward = capturing
    policy = Recorder(max_k=4)
    policy.flags = []
    engine = SpeculativeEngine(target, None, PromptLookupDrafter(), EngineConfig(max_batch_size=1, max_seq_len=96),
                               k_policy=policy)
    engine.generate([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=30), SpecParams(num_draft_tokens=4))
    assert False in policy.flags and True in policy.flags


def test_drafters_do_their_one_time_work_at_admission(tiny_models):
    """The engine admits each request into the drafter with the prefill: prompt lookup has indexed the prompt and
    a model drafter has prefilled its cache before the first decode step, so the first speculative step (which the
    K policy times) costs what any other does. Output is unchanged."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter, PromptLookupDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    target, _ = load_model(tiny_models["llama"])
    draft_model, _ = load_model(tiny_models["draft"])
    fed = []
    forward = draft_model.forward

    def recording(tokens, positions, slots, logits_from=0):
        fed.append(tokens.shape[1])
        return forward(tokens, positions, slots, logits_from)

    draft_model.forward = recording
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 9, 10, 11, 12]
    outputs = []
    for drafter in (PromptLookupDrafter(), ModelDrafter(draft_model)):
        engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=96))
        state = engine._make_states([prompt], SamplingParams(max_tokens=8), False)[0]
        engine._prefill(state, 0)
        if isinstance(drafter, PromptLookupDrafter):
            assert drafter._index[state.request_id].tokens == prompt  # indexed at admission
        else:
            assert fed == [len(prompt) - 1] and drafter._fed[state.request_id] == prompt[:-1]
            engine.step([state], [0], SpecParams(num_draft_tokens=3))
            assert fed[1] == 1  # the first propose feeds only the last token
        engine.drafter.release(state.request_id)
        outputs.append(engine.generate(prompt, SamplingParams(max_tokens=12), SpecParams(num_draft_tokens=3)).token_ids)
    plain = SpeculativeEngine(target, None, None, EngineConfig(max_batch_size=1, max_seq_len=96))
    assert outputs[0] == outputs[1] == plain.generate(prompt, SamplingParams(max_tokens=12)).token_ids


def _simulate_with_stalls(policy: AdaptiveK | None, k_fixed: int, steps: int, seed: int) -> float:
    """32 rows, acceptance 0.93, a step costs 5 + 0.3 K (ms), and now and then a step stalls for 60 ms whatever its
    K (a GC pause, the host scheduler); the second timed step at K = 4 always does. The case of an H100 run (512-token
    answers, about 200 steps) where one stalled K=4 step kept K=4 'costing' 18 ms against a real ~6.5: the policy
    settled on K=1 at 1.15x of speculation off while a fixed K=4 gave 1.43x."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    at4 = 0
    for _ in range(steps):
        k = policy.choose(32, 4) if policy else k_fixed
        at4 += k == 4
        cost = 5.0 + 0.3 * k + (60.0 if rng.random() < 0.01 or (k == 4 and at4 == 2) else 0.0)
        accepted = []
        for _ in range(32):
            n = 0
            while n < k and rng.random() < 0.93:
                n += 1
            accepted.append(n)
        tokens += sum(a + 1 for a in accepted)
        seconds += cost
        if policy:
            policy.observe(32, k, cost, [k] * 32, accepted)
    return tokens / seconds


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_policy_is_not_misled_by_stalled_steps(seed):
    best_fixed = max(_simulate_with_stalls(None, k, 200, seed) for k in range(5))
    # A 200-step run pays for learning (about 10 steps at K=1); without forgetting the stalled K=4 the policy
    # stays at K=1: 0.53-0.64 of the best fixed K on these seeds.
    assert _simulate_with_stalls(AdaptiveK(max_k=4), 0, 200, seed) >= 0.8 * best_fixed


def _simulate_coverage(policy: AdaptiveK | None, k_fixed: int, steps: int, coverage: float, seed: int = 0,
                       first_k0_cost: float | None = None) -> float:
    """32 rows; only a `coverage` share of the rows gets drafts at all (prompt lookup where the context repeats),
    those accept each draft with probability 0.8. A decode step costs 1.0, a verify step 1.6 + 0.05 K (a target
    that verifying makes compute-bound). `first_k0_cost`: K = 0 steps within the first 20 measure this instead (a
    warm-up period), as on an H100 where K = 0 was measured 40% high early and never again."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for step in range(steps):
        k = policy.choose(32, 4) if policy else k_fixed
        cost = 1.0 if k == 0 else 1.6 + 0.05 * k
        seconds += cost
        if k == 0 and first_k0_cost is not None and step < 20:
            cost = first_k0_cost
        drafts = [k if rng.random() < coverage else 0 for _ in range(32)]
        accepted = []
        for n in drafts:
            a = 0
            while a < n and rng.random() < 0.8:
                a += 1
            accepted.append(a)
        tokens += sum(a + 1 for a in accepted)
        if policy:
            policy.observe(32, k, cost, drafts, accepted)
    return tokens / seconds


def test_policy_counts_rows_without_drafts():
    """With 30% of rows drafting, speculation costs more than it emits (fixed K=4: 0.95x of off), though each
    drafted token is accepted 80% of the time. Acceptance alone would pick K=4; with the coverage the policy stays
    at K=0."""
    off = _simulate_coverage(None, 0, 400, 0.3)
    assert _simulate_coverage(None, 4, 400, 0.3) < 0.97 * off
    policy = AdaptiveK(max_k=4)
    assert _simulate_coverage(policy, 0, 400, 0.3) >= 0.97 * off
    assert 0.2 < policy.coverage < 0.4 and policy.choose(32, 4) == 0
    full = AdaptiveK(max_k=4)  # every row drafting: the same costs pay for K=4
    _simulate_coverage(full, 0, 400, 1.0)
    assert full.choose(32, 4) == 4


def test_policy_remeasures_the_cost_of_no_speculation():
    """K = 0 measured 1.9x its real cost in the first steps: exploration must come back to K = 0 and correct it
    (without that, the policy stays at K=4: 0.94x of off, against 0.97x with it)."""
    off = _simulate_coverage(None, 0, 600, 0.3)
    policy = AdaptiveK(max_k=4)
    on = _simulate_coverage(policy, 0, 600, 0.3, first_k0_cost=1.9)
    assert policy.choose(32, 4) == 0 and policy.costs(32)[0] == pytest.approx(1.0)
    assert on >= 0.9 * off
