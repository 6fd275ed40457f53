"""The engine end to end on tiny random models: greedy equals Hugging Face, seeds reproduce, batches equal
single runs, stopping rules hold."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.adaptive import AdaptiveK
from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ModelDrafter, PromptLookupDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model
from pipeline.sequence import RequestState

PROMPTS = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7]]
MAX_NEW = 24


def _hf_greedy(path: str, prompt: list[int], max_new: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _engine(target_path: str, drafter: str | None, batch: int = 4) -> SpeculativeEngine:
    target, _ = load_model(target_path)
    if drafter == "lookup":
        d = PromptLookupDrafter()
    elif drafter is None:
        d = None
    else:
        d = ModelDrafter(load_model(drafter)[0])
    return SpeculativeEngine(target, None, d, EngineConfig(max_batch_size=batch, max_seq_len=128))


@pytest.fixture(scope="module")
def hf_reference(tiny_models):
    cache = {}

    def get(name: str, prompt_index: int) -> list[int]:
        key = (name, prompt_index)
        if key not in cache:
            cache[key] = _hf_greedy(str(tiny_models[name]), PROMPTS[prompt_index], MAX_NEW)
        return cache[key]

    return get


@pytest.mark.parametrize("target", ["llama", "llama_mha_tied", "qwen2"])
@pytest.mark.parametrize("drafter", ["draft", "self", "lookup", None])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_hf_generate(tiny_models, hf_reference, target, drafter, k):
    draft_path = {"draft": str(tiny_models["draft"]), "self": str(tiny_models[target]), "lookup": "lookup",
                  None: None}[drafter]
    engine = _engine(str(tiny_models[target]), draft_path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # Unbatched, then all prompts in one batch: both must equal HF token for token.
    for i, prompt in enumerate(PROMPTS):
        got = engine.generate(prompt, params, SpecParams(num_draft_tokens=k))
        assert got.token_ids == hf_reference(target, i), f"prompt {i} (unbatched)"
    batch = engine.generate_batch(PROMPTS, params, SpecParams(num_draft_tokens=k))
    for i, got in enumerate(batch):
        assert got.token_ids == hf_reference(target, i), f"prompt {i} (batched)"
    if drafter == "self":  # the target drafting for itself is always right: K+1 tokens per pass
        s = batch[0].stats
        assert s["acceptance_rate"] == 1.0 and s["target_passes"] == -(-MAX_NEW // (k + 1))


def test_sampled_output_reproducible_and_batch_invariant(tiny_models):
    engine = _engine(str(tiny_models["llama"]), str(tiny_models["draft"]))
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True) for s in (11, 12, 13)]
    spec = SpecParams(num_draft_tokens=3)
    singles = [engine.generate(p, q, spec).token_ids for p, q in zip(PROMPTS, params)]
    again = [engine.generate(p, q, spec).token_ids for p, q in zip(PROMPTS, params)]
    batched = [r.token_ids for r in engine.generate_batch(PROMPTS, params, spec)]
    assert singles == again == batched
    other = engine.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=99,
                                                       ignore_eos=True), spec)
    assert other.token_ids != singles[0], "a different seed should give a different sample"


def test_unseeded_request_reports_its_seed_and_replays(tiny_models):
    engine = _engine(str(tiny_models["llama"]), "lookup")
    first = engine.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    replay = engine.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=16, seed=first.seed,
                                                        ignore_eos=True))
    assert replay.token_ids == first.token_ids


def test_more_requests_than_slots(tiny_models):
    engine = _engine(str(tiny_models["llama"]), str(tiny_models["draft"]), batch=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = PROMPTS * 2
    results = engine.generate_batch(prompts, params, SpecParams(num_draft_tokens=2))
    single = [engine.generate(p, params, SpecParams(num_draft_tokens=2)).token_ids for p in prompts]
    assert [r.token_ids for r in results] == single


def test_max_tokens_never_exceeded_and_eos_stops(tiny_models):
    engine = _engine(str(tiny_models["llama"]), str(tiny_models["llama"]))  # accepts everything: K+1 per pass
    for max_tokens in (1, 2, 5, 7):
        r = engine.generate(PROMPTS[0], SamplingParams(max_tokens=max_tokens, ignore_eos=True), SpecParams(4))
        assert len(r.token_ids) == max_tokens and r.finish_reason == "length"
    full = engine.generate(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True), SpecParams(4)).token_ids
    eos = full[6]
    first = full.index(eos)
    engine.target.info = type(engine.target.info)(**{**engine.target.info.__dict__, "eos_token_ids": (eos,)})
    r = engine.generate(PROMPTS[0], SamplingParams(max_tokens=12), SpecParams(4))
    assert r.token_ids == full[: first + 1] and r.finish_reason == "stop"


def test_stream_yields_every_token_once(tiny_models):
    engine = _engine(str(tiny_models["llama"]), "lookup")
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    streamed = []
    for event in engine.stream(PROMPTS[1], params, SpecParams(3)):
        streamed += event.token_ids
        if event.finished:
            assert event.result is not None and event.result.token_ids == streamed
    assert len(streamed) == 15


def test_abandoned_stream_frees_its_slot(tiny_models):
    engine = _engine(str(tiny_models["llama"]), str(tiny_models["draft"]), batch=1)
    it = engine.stream(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), SpecParams(2))
    next(it)
    it.close()  # the client went away
    assert engine.generate(PROMPTS[1], SamplingParams(max_tokens=3)).token_ids  # the only slot is free again


# ---- stopping on text, with a character-level tokenizer at the seam -------------------------------------


class CharTokenizer:
    """token id = ord(char); enough for RequestState's text handling."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _state(stop=(), max_tokens=50, eos=()):
    s = RequestState("r", [ord(c) for c in "> "], SamplingParams(max_tokens=max_tokens, stop=stop, seed=0), eos)
    s.attach_tokenizer(CharTokenizer())
    return s


def _commit_text(state, chunks):
    out = []
    for chunk in chunks:
        if state.finished:
            break
        ids, text = state.commit([ord(c) for c in chunk], len(chunk) - 1, len(chunk) - 1)
        out.append(text)
    return "".join(out)


def test_stop_string_inside_an_accepted_block_truncates():
    s = _state(stop=("END",))
    streamed = _commit_text(s, ["hel", "lo E", "NDxyz", "more"])
    assert s.finish_reason == "stop" and s.text == "hello " and streamed == "hello "
    assert "".join(chr(t) for t in s.output_ids) == "hello END"  # nothing after the stop is committed


def test_stop_prefix_is_held_back_until_resolved():
    s = _state(stop=("END",))
    assert _commit_text(s, ["ab E"]) == "ab "  # "E" might start "END"
    assert _commit_text(s, ["X"]) == "EX"  # it did not


def test_eos_and_max_tokens_in_the_same_block():
    s = _state(eos=(ord("!"),))
    _commit_text(s, ["hi!there"])
    assert s.finish_reason == "stop" and s.text == "hi" and len(s.output_ids) == 3
    s = _state(max_tokens=4)
    _commit_text(s, ["abcdefgh"])
    assert s.finish_reason == "length" and s.output_ids == [ord(c) for c in "abcd"]


def test_state_roundtrips_through_a_dict():
    s = _state(stop=("END",))
    _commit_text(s, ["abc", "de"])
    t = RequestState.from_dict(s.to_dict(), CharTokenizer())
    assert t.output_ids == s.output_ids and t.step == s.step == 2 and t.text == s.text
    assert _commit_text(t, ["fEND"]) == "f" and t.finished


def test_prompt_lookup_finds_most_recent_continuation():
    d = PromptLookupDrafter(max_ngram=2)
    assert d.lookup([1, 2, 3, 9, 1, 2, 4, 7, 1, 2], 3) == [4, 7, 1]
    assert d.lookup([1, 2, 3], 3) == []


def test_model_drafter_evicts_least_recent_request_when_slots_run_out(tiny_models):
    """More live requests than drafter slots: an evicted request is re-fed, and its drafts do not change."""
    from pipeline.drafters import ProposeRow
    from pipeline.sampling import SamplingTensors

    small, big = load_model(tiny_models["draft"])[0], load_model(tiny_models["draft"])[0]
    small.allocate(1, 128)
    big.allocate(3, 128)
    one, three = ModelDrafter(small), ModelDrafter(big)
    sampling = SamplingTensors.from_params([SamplingParams(seed=0)])
    steps = torch.zeros(1, dtype=torch.int64)
    contexts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2]}
    for rid in ["a", "b", "a", "c", "b", "a"]:
        contexts[rid] = list(contexts[rid]) + [7]
        row = [ProposeRow(rid, contexts[rid], 3)]
        got = one.propose(row, 3, sampling, steps, 8).token_ids
        want = three.propose(row, 3, sampling, steps, 8).token_ids
        assert torch.equal(got, want), rid
    assert len(one._slots) == 1


def test_prompt_lookup_feeds_only_the_columns_it_drafted(tiny_models):
    """A step where the lookup finds nothing is a plain decode (T = 1), and a short match is verified at its
    own length, not padded to K: padding columns would cost a K+1-token target pass for nothing."""
    engine = _engine(str(tiny_models["llama"]), "lookup", batch=1)
    fed: list[int] = []
    forward = engine.target.forward

    def recording(tokens, positions, slots, logits_from=0):
        fed.append(tokens.shape[1])
        return forward(tokens, positions, slots, logits_from)

    engine.target.forward = recording
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # no repeated token: nothing to look up at first
    result = engine.generate(prompt, SamplingParams(max_tokens=24), SpecParams(num_draft_tokens=4))
    steps = fed[1:]  # fed[0] is the prefill
    drafted = result.stats["drafted"]
    assert len(steps) == result.stats["target_passes"]
    assert sum(t - 1 for t in steps) == drafted  # every fed column past the first was a real draft token
    assert steps[0] == 1  # the first step had no match
    assert result.token_ids == _engine(str(tiny_models["llama"]), None, batch=1).generate(
        prompt, SamplingParams(max_tokens=24)).token_ids


def test_prompt_lookup_index_equals_the_scan():
    """The per-request incremental n-gram index gives exactly the scan's answer, step after step, for
    contexts that grow by 1-5 tokens at a time, after a rebuild (a context that does not extend the
    indexed one) and after release."""
    import random

    rng = random.Random(0)
    d = PromptLookupDrafter()
    for trial in range(30):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        for step in range(60):
            num = rng.randrange(0, 6)
            assert d.lookup(ctx, num, key=f"r{trial}") == d.lookup(ctx, num), (trial, step)
            ctx = ctx + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
        other = [rng.randrange(6) for _ in range(20)]  # not an extension of the indexed context
        assert d.lookup(other, 4, key=f"r{trial}") == d.lookup(other, 4)
        d.release(f"r{trial}")
    assert not d._index


def test_hybrid_drafter_uses_both_sources_and_keeps_outputs_exact(tiny_models):
    """lookup+MODEL: rows whose context repeats an n-gram take the lookup, the others the draft model, in one
    step. Greedy output equals target-only decoding; a seeded sampled request replays exactly, alone or batched
    with others; each source served some rows."""
    from pipeline.drafters import HybridDrafter, build_drafter

    target, tok = load_model(tiny_models["llama"])
    hybrid = build_drafter(f"lookup+{tiny_models['draft']}", target.info, tok)
    assert isinstance(hybrid, HybridDrafter) and hybrid.name.startswith("lookup+")
    cfg = EngineConfig(max_batch_size=4, max_seq_len=128)
    engine = SpeculativeEngine(target, None, hybrid, cfg)
    plain = SpeculativeEngine(target, None, None, cfg)
    repetitive = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # the lookup finds continuations here
    fresh = [11, 23, 42, 7, 99, 3, 64]
    greedy = SamplingParams(max_tokens=24)
    spec = SpecParams(num_draft_tokens=3)
    got = engine.generate_batch([repetitive, fresh], greedy, spec)
    want = plain.generate_batch([repetitive, fresh], greedy)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert hybrid.lookup_rows > 0 and hybrid.model_rows > 0
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    alone = engine.generate(fresh, sampled, spec).token_ids
    again = engine.generate(fresh, sampled, spec).token_ids
    batched = engine.generate_batch([repetitive, fresh], [SamplingParams(max_tokens=24, temperature=0.9, seed=3),
                                                          sampled], spec)[1].token_ids
    assert alone == again == batched


def test_hybrid_block_ships_the_distribution_each_row_was_drawn_from(tiny_models):
    """A lookup row's support is a point mass at each token; a model row's is exactly what the draft model alone
    proposes for it (same tokens, same sparse distribution: its randomness is keyed by the row, not the batch)."""
    from pipeline.drafters import HybridDrafter, ProposeRow
    from pipeline.rejection import _dense_draft_probs
    from pipeline.sampling import SamplingTensors

    draft_model, _ = load_model(tiny_models["draft"])
    draft_model.allocate(4, 64)
    hybrid = HybridDrafter(ModelDrafter(draft_model))
    alone = ModelDrafter(load_model(tiny_models["draft"])[0])
    alone.model.allocate(4, 64)
    rows = [ProposeRow("r", [5, 6, 7, 8, 5, 6, 7], 3), ProposeRow("f", [11, 23, 42, 7, 99], 3)]
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2)]
    sampling, steps = SamplingTensors.from_params(params), torch.tensor([4, 9])
    block = hybrid.propose(rows, 3, sampling, steps, 8)
    ref = alone.propose(rows[1:], 3, sampling.select([1]), steps[1:], 8)
    assert block.token_ids[0].tolist() == [8, 5, 6] and int(block.num_draft[0]) == 3
    dense = _dense_draft_probs(block, torch.ones(2, 3, dtype=torch.bool), draft_model.info.vocab_size)
    for i, t in enumerate([8, 5, 6]):
        assert dense[0, i, t] == 1.0 and dense[0, i].sum() == 1.0
    assert torch.equal(block.token_ids[1], ref.token_ids[0])
    torch.testing.assert_close(dense[1, :3], _dense_draft_probs(ref, torch.ones(1, 3, dtype=torch.bool),
                                                                draft_model.info.vocab_size)[0, :3])


def test_fp8_draft_weights_on_cpu_is_a_clear_error(tiny_models):
    """draft_weights='fp8' is a CUDA graph-path option: asked for on a CPU drafter it fails at construction, with
    a message that says so, instead of being silently ignored."""
    target, _ = load_model(tiny_models["llama"])
    drafter = ModelDrafter(load_model(tiny_models["draft"])[0])
    with pytest.raises(ValueError, match="needs the draft model on a CUDA device"):
        SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=64,
                                                               draft_weights="fp8"))
    with pytest.raises(ValueError, match="which graphs=False turns off"):
        SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=64,
                                                               draft_weights="fp8", graphs=False))


def test_warmup_without_graphs_captures_nothing_and_steps_are_counted_by_k(tiny_models):
    """On CPU (no CUDA graphs) warmup is a no-op; a bad K is refused. `timings.steps_by_k` counts every target
    pass by the draft tokens it verified (the GPU tests check warmup's captures)."""
    engine = _engine(str(tiny_models["llama"]), "lookup", batch=2)
    assert engine.warmup(4)["captures"] == 0
    with pytest.raises(ValueError, match="max_draft_tokens must be >= 0"):
        engine.warmup(-1)
    result = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=16), SpecParams(num_draft_tokens=3))
    by_k = engine.timings.steps_by_k
    assert sum(by_k.values()) == engine.timings.steps == result.stats["target_passes"]
    assert sum(k * n for k, n in by_k.items()) == result.stats["drafted"]


def test_policy_costs_leave_out_the_drafters_catch_up(tiny_models, monkeypatch):
    """A drafter's `prepare` (prompt lookup's index catching up on tokens committed while K was 0) is a one-time
    price of switching K on: the K policy's measured step costs leave it out. The engine's clock is a fake one
    (1 ms a reading; a loaded CI machine cannot move it): `prepare` takes 1 s of it a call, a step's own readings a
    few ms. The output is unchanged."""
    import pipeline.engine as engine_module

    class Clock:  # time.perf_counter as the engine reads it: 1 ms a call, plus what `prepare` spends
        t = 0.0

        def perf_counter(self) -> float:
            self.t += 1e-3
            return self.t

    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)

    class SlowCatchUp(PromptLookupDrafter):
        def prepare(self, rows) -> None:
            clock.t += 1.0
            super().prepare(rows)

    target, _ = load_model(str(tiny_models["llama"]))
    drafter = SlowCatchUp()
    engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=128),
                               k_policy=AdaptiveK(max_k=2))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    result = engine.generate(prompt, SamplingParams(max_tokens=24), SpecParams(num_draft_tokens=2))
    costs = engine.k_policy.costs(1)
    assert costs and max(costs.values()) < 0.1 and 1 in costs, costs  # with the catch-up a K > 0 step costs > 1 s
    assert result.token_ids == _engine(str(tiny_models["llama"]), None, batch=1).generate(
        prompt, SamplingParams(max_tokens=24)).token_ids


def test_token_view_reads_like_the_concatenated_list():
    from pipeline.sequence import TokenView

    head, tail = [5, 6, 7], [8, 9]
    view, want = TokenView(head, tail), head + tail
    assert len(view) == 5 and list(view) == want
    assert [view[i] for i in range(-5, 5)] == [want[i] for i in range(-5, 5)]
    for sl in (slice(None), slice(1, 4), slice(3, 5), slice(0, 2), slice(-2, None), slice(4, 1), slice(None, None, 2),
               slice(-1, None, -1), slice(2, 3), slice(10, 20)):
        assert view[sl] == want[sl], sl
    for bad in (5, -6):
        with pytest.raises(IndexError):
            view[bad]
    tail.append(10)  # a live view: what the state appends shows
    assert view[-1] == 10 and len(view) == 6
    state_view = TokenView([], [1])
    assert list(state_view) == [1] and state_view[:] == [1]


def test_common_prefix_equals_the_element_loop():
    from pipeline.drafters import _common_prefix

    def loop(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    g = random.Random(7)
    for _ in range(400):
        n = g.randrange(0, 300)
        a = [g.randrange(4) for _ in range(n)]
        b = a[: g.randrange(0, n + 1)] + [g.randrange(4) for _ in range(g.randrange(0, 80))]
        if b and g.random() < 0.3:  # a difference anywhere, also before the last window
            b[g.randrange(len(b))] = 9
        for x, y in ((a, b), (b, a)):
            assert _common_prefix(x, y, window=16) == loop(x, y) == _common_prefix(x, y)
