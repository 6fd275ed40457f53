"""Feature heads (Medusa, EAGLE-3) in the published checkpoint layouts, with random weights, in the engine: drafts
equal a plain reference forward of the same weights; greedy output equals the target's; sampled output follows
the target's distribution (with a negative control) and replays from its seed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ProposeRow, build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.heads.drafter import HeadDrafter
from pipeline.models.loader import load_model
from pipeline.rejection import accept, verify
from pipeline.sampling import SamplingTensors, warp
from tests.support.heads import eagle3_reference, make_eagle3_checkpoint, make_medusa_checkpoint, medusa_reference
from tests.support.models import make_tiny_llama

V = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = make_tiny_llama(root / "target", vocab_size=V, hidden=32, layers=6, heads=4, kv_heads=2,
                             max_position_embeddings=512, seed=11)
    cfg = json.loads((target / "config.json").read_text())
    return {
        "target": target,
        "medusa": make_medusa_checkpoint(root / "medusa", 32, V, heads=3, layers=1, seed=1),
        "medusa2": make_medusa_checkpoint(root / "medusa2", 32, V, heads=4, layers=2, seed=2, prefix=""),
        "eagle3": make_eagle3_checkpoint(root / "eagle3", cfg, draft_vocab=96, seed=3),  # default layers (2, 3, 3)
        "eagle3_own": make_eagle3_checkpoint(root / "eagle3_own", cfg, draft_vocab=V, seed=4, aux_layers=[0, 2, 5],
                                             own_embed=True),
    }


def _engine(setup, word: str, batch: int = 4, max_seq_len: int = 256) -> SpeculativeEngine:
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(f"{word}:{setup[word.split(':')[0]]}" if ":" not in word else word, model.info, tok,
                            target=model) if word else None
    return SpeculativeEngine(model, tok, drafter, EngineConfig(max_batch_size=batch, max_seq_len=max_seq_len))


def _word(setup, name: str) -> str:
    return f"{'medusa' if name.startswith('medusa') else 'eagle3'}:{setup[name]}"


PROMPTS = [[1, 5, 9, 17, 33, 65], [3, 4], [7] * 12 + [8, 9, 10], [100, 2 % V, 50, 51, 52, 53, 54, 55, 56]]


@pytest.mark.parametrize("name", ["medusa", "medusa2", "eagle3", "eagle3_own"])
def test_engine_drafts_equal_a_reference_forward_of_the_checkpoint(setup, name):
    model, tok = load_model(str(setup["target"]))
    drafter = build_drafter(_word(setup, name), model.info, tok, target=model)
    assert isinstance(drafter, HeadDrafter)
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(rows, k, sampling, steps, top_k):
        block = propose(rows, k, sampling, steps, top_k)
        for b, r in enumerate(rows):
            seen.append((list(r.context), block.token_ids[b, : int(block.num_draft[b])].tolist()))
        return block

    drafter.propose = recording
    engine = SpeculativeEngine(model, tok, drafter, EngineConfig(max_batch_size=4, max_seq_len=256))
    engine.generate_batch(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True), SpecParams(num_draft_tokens=3))
    hf = AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    reference = medusa_reference if name.startswith("medusa") else eagle3_reference
    checked = 0
    for context, drafts in seen:
        if drafts:
            assert drafts == reference(hf, setup[name], context, len(drafts)), context
            checked += 1
    assert checked >= 12, f"only {checked} draft calls were checked"


@pytest.mark.parametrize("name", ["medusa", "eagle3"])
def test_greedy_output_equals_the_targets_and_sampled_replays(setup, name):
    plain = _engine(setup, "")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in plain.generate_batch(PROMPTS, params)]
    engine = _engine(setup, _word(setup, name))
    got = engine.generate_batch(PROMPTS, params, SpecParams(num_draft_tokens=4))
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["drafted"] for r in got) > 0
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    first = engine.generate(PROMPTS[0], sampled, SpecParams(3)).token_ids
    assert engine.generate(PROMPTS[0], sampled, SpecParams(3)).token_ids == first
    batch = engine.generate_batch([PROMPTS[0], PROMPTS[2]], sampled, SpecParams(3))
    assert batch[0].token_ids == first  # the same request in another batch


@pytest.mark.parametrize("name", ["eagle3", "eagle3_own"])
def test_the_static_eagle3_draft_equals_the_eager_one(setup, name):
    """`HeadDrafter.static` (the draft on static buffers, one CUDA graph per shape on a GPU; uncaptured here): batches
    whose rows join and leave, greedy and seeded, emit exactly what the eager draft emits, step by step."""
    def run(static: bool):
        engine = _engine(setup, _word(setup, name), max_seq_len=320)
        engine.head.static = static
        out = []
        for params in (SamplingParams(max_tokens=40, ignore_eos=True),
                       SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=5)):
            rows = [dataclasses.replace(params, max_tokens=n).with_seed() for n in (40, 13, 29, 21)]  # leave in turn
            events = list(engine._run(engine._make_states(PROMPTS, rows, False), SpecParams(4)))
            out.append([(e.token_ids, e.result and (e.result.stats["drafted"], e.result.stats["accepted"]))
                        for e in events])
        return out, engine

    eager, _ = run(False)
    static, engine = run(True)
    assert static == eager
    assert engine.head._chains  # the static path ran
    assert sum(stats[0] for run_ in static for _, stats in run_ if stats) > 0  # and drafted


def _first_tokens(setup, name: str, n: int, claim: str) -> tuple[torch.Tensor, torch.Tensor]:
    """n seeded single-step requests (T=1) from one context: the head's drafts verified by the target. claim
    "own": the block as the head ships it; "uniform" (a broken drafter): its tokens, with uniform probabilities
    claimed over the support it shipped."""
    model, tok = load_model(str(setup["target"]))
    model.allocate(1, 64)
    drafter = build_drafter(_word(setup, name), model.info, tok, target=model)
    drafter.allocate(n, 64)
    context = PROMPTS[0]
    logits, feats = model.forward_features(torch.tensor([context[:-1]]), torch.zeros(1, dtype=torch.int64),
                                           torch.zeros(1, dtype=torch.int64), drafter.feature_layers)
    rows = []
    for i in range(n):
        drafter.admit(f"r{i}", context)
        drafter.observe(f"r{i}", 0, feats[0], context[1:])
        rows.append(ProposeRow(f"r{i}", context, 2))
    params = [SamplingParams(temperature=1.0, seed=1000 + i) for i in range(n)]
    sampling = SamplingTensors.from_params(params)
    steps = torch.zeros(n, dtype=torch.int64)
    block = drafter.propose(rows, 2, sampling, steps, 64)
    if claim == "uniform":
        block.top_probs = (block.top_probs > 0).float() / (block.top_probs > 0).float().sum(-1, keepdim=True)
    t_logits = model.forward(torch.tensor([[context[-1]] + block.token_ids[0].tolist()]),
                             torch.tensor([len(context) - 1]), torch.zeros(1, dtype=torch.int64))
    # Every row feeds the same context; the target's distribution at the pending position is one row's.
    target_probs = warp(t_logits[:, :1], sampling.select([0]))[0, 0]  # [V]
    # Rows drafted different tokens, so verify each against the target at its own drafts: the first emitted token
    # depends only on the first position's distribution and the first draft, both of which are the same per row.
    out = accept(verify(t_logits.expand(n, -1, -1).clone(), block, sampling, steps), block, sampling.seeds, steps)
    return out.tokens[:, 0], target_probs


@pytest.mark.parametrize("name", ["medusa", "eagle3"])
def test_sampled_first_token_follows_the_target_and_a_wrong_claim_does_not(setup, name):
    from tests.pipeline.test_rejection import ALPHA, _pvalue

    tokens, target = _first_tokens(setup, name, 20_000, "own")
    assert _pvalue(tokens, target) > ALPHA
    tokens, target = _first_tokens(setup, name, 20_000, "uniform")
    assert _pvalue(tokens, target) < 1e-6
