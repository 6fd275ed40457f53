"""The real demo model (SmolLM2-135M-Instruct): greedy speculative output equals Hugging Face's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ModelDrafter, PromptLookupDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react. "
    "The fox, the quick brown fox, ran away.",
    "List three prime numbers.",
]
NEW = 24


@pytest.fixture(scope="module")
def demo(demo_path):
    model, tok = load_model(demo_path)
    engine = SpeculativeEngine(model, tok, None, EngineConfig(max_batch_size=2, max_seq_len=256))
    hf = AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32).eval()
    prompts = [engine.encode(p, chat=True) for p in PROMPTS]
    with torch.inference_mode():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    return engine, prompts, ref


def _cut_at_eos(ids, eos=(2,)):
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


@pytest.mark.parametrize("k", [1, 3, 5])
def test_demo_greedy_equals_hf_with_prompt_lookup(demo, k):
    engine, prompts, ref = demo
    engine.drafter = PromptLookupDrafter()
    params = SamplingParams(max_tokens=NEW)
    try:
        for p, r in zip(prompts, ref):
            assert engine.generate(p, params, SpecParams(k)).token_ids == _cut_at_eos(r)
        batched = engine.generate_batch(prompts, params, SpecParams(k))
    finally:
        engine.drafter = None
    assert [b.token_ids for b in batched] == [_cut_at_eos(r) for r in ref]


def test_demo_model_drafter_greedy_equals_hf(demo, demo_path):
    """A separate model drafter (a second copy of the target: every draft accepted)."""
    engine, prompts, ref = demo
    draft_model, _ = load_model(demo_path)
    draft_model.allocate(2, 256 + 80)
    engine.drafter = ModelDrafter(draft_model)
    try:
        out = engine.generate_batch(prompts, SamplingParams(max_tokens=NEW), SpecParams(3))
    finally:
        engine.drafter = None
    assert [o.token_ids for o in out] == [_cut_at_eos(r) for r in ref]
    assert out[0].stats["acceptance_rate"] == 1.0


def test_demo_text_and_stop_string(demo):
    engine, prompts, ref = demo
    full = engine.generate(prompts[1], SamplingParams(max_tokens=NEW))
    assert full.text and full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    word = full.text.split()[1]
    cut = engine.generate(prompts[1], SamplingParams(max_tokens=NEW, stop=(word,)))
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)


@pytest.mark.parametrize("name", ["smollm2-135m-eagle3", "smollm2-135m-medusa"])
def test_shipped_heads_load_by_name_and_keep_the_greedy_output(demo, name):
    """The shipped feature heads (drafters/, trained on the demo target's own answers) load by name and draft for
    the demo target: the output is HF's greedy output, and the trained head's drafts are accepted."""
    from pipeline.heads.drafter import HeadDrafter

    base, prompts, ref = demo
    word = ("eagle3:" if name.endswith("eagle3") else "medusa:") + name
    engine = SpeculativeEngine(base.target, base.tokenizer, HeadDrafter.from_spec(word, base.target),
                               EngineConfig(max_batch_size=2, max_seq_len=256))
    out = engine.generate_batch(prompts, SamplingParams(max_tokens=NEW), SpecParams(4))
    assert [o.token_ids for o in out] == [_cut_at_eos(r) for r in ref]
    assert sum(o.stats["accepted"] for o in out) > 0
