"""The synthetic-acceptance drafter (a measurement aid) and the ideal-step yardstick.

The drafter's acceptance must come out at alpha (statistically, fixed seeds: deterministic), while the output
stays the target's greedy output token for token, and seeded sampled requests replay."""

from __future__ import annotations

import pytest

from pipeline.config import EngineConfig, SamplingParams, SpecParams, draft_model_spec, parse_synthetic
from pipeline.drafters import build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.ideal import efficiency, ideal_speedup
from pipeline.models.loader import load_model
from pipeline.self_spec import SelfSpecDrafter
from pipeline.synthetic import (
    Recording,
    SyntheticDrafter,
    SyntheticSelfDrafter,
    expected_tokens_per_pass,
    synthetic_proposals,
)

PROMPTS = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7], [64, 3, 99, 12, 12, 40, 1]]
MAX_NEW = 160
K = 4


@pytest.fixture(scope="module")
def recorded(tiny_models, tmp_path_factory):
    """The tiny target's greedy continuations (a target-only run), saved as a recording file."""
    target, _ = load_model(str(tiny_models["llama"]))
    engine = SpeculativeEngine(target, None, None, EngineConfig(max_batch_size=4, max_seq_len=256))
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outputs = [r.token_ids for r in engine.generate_batch(PROMPTS, params)]
    path = tmp_path_factory.mktemp("rec") / "recording.json"
    Recording(PROMPTS, outputs, target.info.vocab_size).save(path)
    return engine, outputs, path


def _spec_engine(engine, drafter) -> SpeculativeEngine:
    return SpeculativeEngine(engine.target, None, drafter, EngineConfig(max_batch_size=4, max_seq_len=256))


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_acceptance_is_alpha_and_greedy_output_is_the_targets(tiny_models, recorded, alpha):
    engine, outputs, path = recorded
    spec = f"synthetic:{alpha}:{tiny_models['draft']}:{path}"
    drafter = build_drafter(spec, engine.target.info, None)
    assert isinstance(drafter, SyntheticDrafter)
    spec_engine = _spec_engine(engine, drafter)
    got = spec_engine.generate_batch(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                                     SpecParams(num_draft_tokens=K))
    assert [r.token_ids for r in got] == outputs  # exact: the verification is the target's
    # A pass's first drafted position is accepted with probability alpha (and each later one given the ones
    # before it were): the pooled first-position acceptance estimates alpha, tokens per pass its expectation.
    passes = sum(r.stats["target_passes"] for r in got)
    first = sum(r.stats["acceptance_by_position"][0] * r.stats["target_passes"] for r in got) / passes
    assert abs(first - alpha) < 0.08, first
    per_pass = sum(len(r.token_ids) for r in got) / passes
    assert abs(per_pass - expected_tokens_per_pass(alpha, K)) < 0.35, per_pass


def test_sampled_requests_replay_and_alpha_one_accepts_everything(tiny_models, recorded):
    engine, outputs, path = recorded
    spec = f"synthetic:1.0:{tiny_models['draft']}:{path}"
    spec_engine = _spec_engine(engine, build_drafter(spec, engine.target.info, None))
    greedy = spec_engine.generate_batch(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True), SpecParams(K))
    assert [r.token_ids for r in greedy] == [o[:40] for o in outputs]
    assert all(r.stats["acceptance_rate"] == 1.0 for r in greedy)
    params = [SamplingParams(temperature=0.8, max_tokens=30, seed=s, ignore_eos=True) for s in (1, 2, 3, 4)]
    first = [r.token_ids for r in spec_engine.generate_batch(PROMPTS, params, SpecParams(K))]
    again = [spec_engine.generate(p, q, SpecParams(K)).token_ids for p, q in zip(PROMPTS, params)]
    assert first == again


def test_self_timed_drafter_spends_self_speculation_and_keeps_alpha(tiny_models, recorded):
    """SHAPE `self`: the drafts are the recording's, the time is the target's own windowed forwards (its slot of
    each request, no draft model of its own); the output stays the target's."""
    engine, outputs, path = recorded
    spec = f"synthetic:0.8:self:{path}"
    with pytest.raises(ValueError, match="build it with the target model"):
        build_drafter(spec, engine.target.info, None)
    drafter = build_drafter(spec, engine.target.info, None, target=engine.target)
    assert isinstance(drafter, SyntheticSelfDrafter) and isinstance(drafter, SelfSpecDrafter)
    assert drafter.model.target is engine.target and (drafter.window, drafter.sinks) == (512, 4)
    assert draft_model_spec(spec) is None  # no model of its own to load or place
    calls = []
    forward = drafter.model.forward
    drafter.model.forward = lambda *a, **kw: calls.append(a[0].shape) or forward(*a, **kw)
    got = _spec_engine(engine, drafter).generate_batch(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
                                                         SpecParams(num_draft_tokens=K))
    assert [r.token_ids for r in got] == outputs
    passes = sum(r.stats["target_passes"] for r in got)
    first = sum(r.stats["acceptance_by_position"][0] * r.stats["target_passes"] for r in got) / passes
    assert abs(first - 0.8) < 0.08, first
    assert len(calls) >= K * max(r.stats["target_passes"] for r in got) // 2  # the windowed forwards ran


def test_proposals_keep_alpha_of_positions_and_replace_with_other_tokens():
    output = list(range(3, 2003))
    props = synthetic_proposals([1, 2, 3], [t % 128 for t in output], 0.7, 128)
    kept = sum(p == t % 128 for p, t in zip(props, output))
    assert abs(kept / len(output) - 0.7) < 0.04
    assert props == synthetic_proposals([1, 2, 3], [t % 128 for t in output], 0.7, 128)  # pure
    assert all(0 <= p < 128 for p in props)
    assert synthetic_proposals([1, 2, 3], [5] * 50, 0.0, 128) != [5] * 50
    assert 5 not in synthetic_proposals([1, 2, 3], [5] * 50, 0.0, 128)  # a replacement always differs


@pytest.mark.parametrize("word, message", [
    ("synthetic:0.8:llama-1b", "expected 'synthetic:ALPHA:SHAPE:RECORDING'"),
    ("synthetic:x:llama-1b:r.json", "is not a number"),
    ("synthetic:1.5:llama-1b:r.json", "ALPHA must be in [0, 1]"),
    ("synthetic::llama-1b:r.json", "expected"),
])
def test_bad_words_are_refused_with_the_form(word, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_synthetic(word)


def test_a_recording_path_may_hold_colons():
    s = parse_synthetic("synthetic:0.8:llama-1b:/tmp/a:b.json")
    assert (s.alpha, s.shape, s.recording) == (0.8, "llama-1b", "/tmp/a:b.json")


def test_ideal_speedup():
    # K=4 at 3.36 tokens a pass, verify 1.06x decode, draft steps 0.15x: 3.36 / (0.6 + 1.06)
    ideal = ideal_speedup(decode_ms=10.0, verify_ms=10.6, draft_step_ms=1.5, k=4, tokens_per_pass=3.36)
    assert ideal.step_ms == pytest.approx(16.6)
    assert ideal.speedup == pytest.approx(3.36 * 10 / 16.6)
    assert ideal.tokens_per_s == pytest.approx(1e3 * 3.36 / 16.6)
    hidden = ideal_speedup(10.0, 10.6, 1.5, 4, 3.36, overlapped=True)
    assert hidden.step_ms == pytest.approx(10.6) and hidden.speedup > ideal.speedup
    slow_draft = ideal_speedup(10.0, 10.6, 4.0, 4, 3.36, overlapped=True)
    assert slow_draft.step_ms == pytest.approx(16.0)
    assert ideal_speedup(10.0, 10.0, 0.0, 0, 1.0).speedup == pytest.approx(1.0)  # K=0 is target-only
    assert efficiency(1.5, ideal) == pytest.approx(1.5 / ideal.speedup)
    with pytest.raises(ValueError, match="tokens_per_pass"):
        ideal_speedup(10.0, 10.6, 1.5, 4, 5.5)
    with pytest.raises(ValueError, match="positive"):
        ideal_speedup(0.0, 10.6, 1.5, 4, 2.0)
