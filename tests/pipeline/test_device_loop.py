"""The device loop (`EngineConfig.device_loop`): the same algorithm as the step-by-step path, read back one step
behind. Its outputs must equal the step path's token for token, greedy and seeded sampled (the drafts, the
uniforms and the verification are the same functions of (seed, step)), with rows that end at different steps."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ModelDrafter, build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.loader import load_model
from pipeline.synthetic import Recording

PROMPTS = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7]]


@pytest.fixture(scope="module")
def models(tiny_models):
    target, _ = load_model(str(tiny_models["llama"]))
    draft, _ = load_model(str(tiny_models["draft"]))
    return target, draft


def _engine(target, drafter, loop: bool) -> SpeculativeEngine:
    return SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=4, max_seq_len=256, device_loop=loop))


def _run(target, draft, loop: bool, params, k: int = 4):
    drafter = None if draft is None else ModelDrafter(draft)
    engine = _engine(target, drafter, loop)
    results = engine.generate_batch(PROMPTS, params, SpecParams(num_draft_tokens=k))
    return [r.token_ids for r in results], [r.stats["target_passes"] for r in results], engine


def test_greedy_equals_the_step_path_and_the_target(models):
    target, draft = models
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 13, 5)]  # rows end at different steps
    want, passes, _ = _run(target, draft, False, params)
    got, got_passes, engine = _run(target, draft, True, params)
    assert got == want
    assert got_passes == passes  # the same drafts: the same passes
    only, _, _ = _run(target, None, True, params)
    assert only == want  # and the target's own greedy output
    assert engine.timings.steps >= max(passes)  # it ran the loop, one collected step per pass


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_sampling_equals_the_step_path_and_replays(models, k):
    target, draft = models
    params = [SamplingParams(max_tokens=20, temperature=t, top_p=p, seed=s, ignore_eos=True)
              for t, p, s in ((0.8, 1.0, 11), (1.0, 0.9, 12), (0.0, 1.0, 13))]  # a greedy row among sampled ones
    want, _, _ = _run(target, draft if k else None, False, params, k)
    got, _, _ = _run(target, draft if k else None, True, params, k)
    again, _, _ = _run(target, draft if k else None, True, params, k)
    assert got == want
    assert again == got
    other = [SamplingParams(max_tokens=20, temperature=0.8, seed=s + 100, ignore_eos=True) for s in (11, 12, 13)]
    assert _run(target, draft if k else None, True, other, k)[0] != got  # the seed matters (negative control)


def test_eos_ends_a_row_and_the_others_go_on(models):
    target, draft = models
    greedy, _, _ = _run(target, None, False, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    eos = greedy[0][5]  # make row 0's sixth token an end-of-sequence token
    saved = target.info
    target.info = dataclasses.replace(saved, eos_token_ids=(eos,))
    try:
        params = SamplingParams(max_tokens=16)
        want, _, _ = _run(target, draft, False, params)
        got, _, _ = _run(target, draft, True, params)
    finally:
        target.info = saved
    assert got == want
    assert len(got[0]) <= 6 and max(len(g) for g in got) > 6


def test_synthetic_drafter_equals_the_step_path(models, tiny_models, tmp_path):
    target, _ = models
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outputs, _, _ = _run(target, None, False, params, 0)
    rec = tmp_path / "rec.json"
    Recording(PROMPTS[:2], outputs[:2], target.info.vocab_size).save(rec)  # the third prompt is unrecorded
    spec = f"synthetic:0.7:{tiny_models['draft']}:{rec}"
    runs = []
    for loop in (False, True):
        engine = _engine(target, build_drafter(spec, target.info, None), loop)
        results = engine.generate_batch(PROMPTS, params, SpecParams(num_draft_tokens=4))
        runs.append(([r.token_ids for r in results], [r.stats["target_passes"] for r in results]))
    assert runs[1] == runs[0]
    assert runs[1][0] == outputs
    assert sum(runs[1][1][:2]) < sum(len(o) for o in outputs[:2]) * 0.6  # recorded rows are accepted often


def test_other_drafters_take_the_step_path(models):
    target, draft = models
    engine = _engine(target, build_drafter("prompt-lookup", target.info, None), True)
    assert not engine._device_loop_fits(engine._make_states(PROMPTS, None, False))
    engine = _engine(target, ModelDrafter(draft), True)
    assert not engine._device_loop_fits(engine._make_states(PROMPTS * 2, None, False))  # more rows than slots


# -- feature heads -----------------------------------------------------------------------------------------------
# Prompts for heads: a long one (its prompt pairs go into the EAGLE-3 cache at the prefill, all but the last), one
# whose pairs outnumber K+1 (the loop's start reads the older ones), one token (no pair: no draft in the first step).
HEAD_PROMPTS = [[5, 17, 33, 17, 33, 9], list(range(20, 46)), [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100]]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A 4-layer tiny target and random-weight heads in the published layouts: Medusa with K heads and with fewer
    (a pass drafts as many as it has), EAGLE-3 over a reduced vocabulary (default layers) and over the whole one."""
    import json

    from tests.support.heads import make_eagle3_checkpoint, make_medusa_checkpoint
    from tests.support.models import make_tiny_llama

    root = tmp_path_factory.mktemp("loop-heads")
    target = make_tiny_llama(root / "target", vocab_size=128, hidden=32, layers=4, heads=4, kv_heads=2,
                             max_position_embeddings=512, seed=21)
    cfg = json.loads((target / "config.json").read_text())
    return {
        "target": target,
        "medusa": make_medusa_checkpoint(root / "medusa", 32, 128, heads=4, layers=1, seed=1),
        "medusa3": make_medusa_checkpoint(root / "medusa3", 32, 128, heads=3, layers=2, seed=2),
        "eagle3": make_eagle3_checkpoint(root / "eagle3", cfg, draft_vocab=96, seed=3),
        "eagle3_full": make_eagle3_checkpoint(root / "eagle3_full", cfg, draft_vocab=128, seed=4,
                                              aux_layers=[0, 2, 4]),
    }


def _head_run(heads, name: str | None, loop: bool, params, k: int = 4, prompts=HEAD_PROMPTS, static: bool = False):
    """static: the target on the graph path's static forward (SDPA over the whole cache, uncaptured), as a
    device-resident target runs it: `forward_static_features` and EAGLE-3's whole-slot attention, on the CPU."""
    target, tok = load_model(str(heads["target"]))
    drafter = None
    if name is not None:
        word = f"{'medusa' if name.startswith('medusa') else 'eagle3'}:{heads[name]}"
        drafter = build_drafter(word, target.info, tok, target=target)
    if static:
        target = GraphCausalLM(target, GraphConfig(graphs=False, compile=False, attention="sdpa", linear="torch"))
    engine = SpeculativeEngine(target, tok, drafter, EngineConfig(max_batch_size=4, max_seq_len=256,
                                                                  device_loop=loop))
    results = engine.generate_batch(prompts, params, SpecParams(num_draft_tokens=k))
    if loop:
        assert engine._loops and all((lp.head is not None) == (name is not None and k > 0)
                                     for lp in engine._loops.values())
    return ([r.token_ids for r in results], [(r.stats["target_passes"], r.stats["accepted"]) for r in results])


@pytest.mark.parametrize("name", ["medusa3", "eagle3"])
def test_heads_greedy_equals_the_step_path_and_the_target(heads, name):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 13, 30, 5)]  # rows end at different steps
    want, want_stats = _head_run(heads, name, False, params)
    got, got_stats = _head_run(heads, name, True, params)
    assert got == want
    assert got_stats == want_stats  # the same drafts: the same passes and accepted counts
    assert got == _head_run(heads, None, False, params)[0]  # the target's own greedy output


@pytest.mark.parametrize("name", ["eagle3_full"])  # Medusa sampled: the device-resident test below
def test_heads_seeded_sampling_equals_the_step_path_and_replays(heads, name):
    params = [SamplingParams(max_tokens=m, temperature=t, top_p=p, seed=s, ignore_eos=True)
              for m, t, p, s in ((20, 0.8, 1.0, 11), (9, 1.0, 0.9, 12), (20, 0.0, 1.0, 13), (16, 1.2, 1.0, 14))]
    want, want_stats = _head_run(heads, name, False, params, 3)
    got, got_stats = _head_run(heads, name, True, params, 3)
    assert got == want
    assert got_stats == want_stats
    assert sum(a for _, a in got_stats) > 0  # drafts were accepted: the heads' distributions took part
    assert _head_run(heads, name, True, params, 3)[0] == got  # replays
    other = [SamplingParams(max_tokens=20, temperature=0.8, seed=s + 100, ignore_eos=True) for s in (11, 12, 13, 14)]
    assert _head_run(heads, name, True, other, 3)[0] != got  # the seed matters (negative control)


@pytest.mark.parametrize("name", ["medusa", "eagle3"])
def test_heads_on_the_device_resident_path_equal_the_step_path(heads, name, monkeypatch):
    """The code a CUDA loop captures, run uncaptured on the CPU: the verify pass's features from the static forward
    (EAGLE-3's default layers of this target name one layer twice) and EAGLE-3 attending over its whole slot."""
    monkeypatch.setattr(GraphCausalLM, "device_resident", lambda self: True)
    params = [SamplingParams(max_tokens=m, temperature=0.9, seed=s, ignore_eos=True)
              for m, s in ((20, 1), (9, 2), (17, 3), (12, 4))]
    want = _head_run(heads, name, False, params, static=True)
    got = _head_run(heads, name, True, params, static=True)
    assert got == want
    assert sum(a for _, a in got[1]) > 0


def test_a_head_behind_prompt_lookup_takes_the_step_path(heads):
    target, tok = load_model(str(heads["target"]))
    drafter = build_drafter(f"lookup+eagle3:{heads['eagle3']}", target.info, tok, target=target)
    engine = SpeculativeEngine(target, tok, drafter, EngineConfig(max_batch_size=4, max_seq_len=256, device_loop=True))
    assert not engine._device_loop_fits(engine._make_states(HEAD_PROMPTS, None, False))
    drafter = build_drafter(f"eagle3:{heads['eagle3']}", target.info, tok, target=target)
    engine = SpeculativeEngine(target, tok, drafter, EngineConfig(max_batch_size=4, max_seq_len=256, device_loop=True))
    assert engine._device_loop_fits(engine._make_states(HEAD_PROMPTS, None, False))
