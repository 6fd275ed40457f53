"""`specserve distill` (issue 8): the loop end to end on a tiny random target, its parts, and the shipped drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.distill.evaluate import acceptance_report, simulate
from pipeline.distill.generate import SampleSet
from pipeline.distill.train import collate, epoch_batches
from pipeline.distill.vocab import coverage, draft_vocabulary

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "smollm2-135m-distill"


# ---- acceptance arithmetic: literal tables -------------------------------------------------------

@pytest.mark.parametrize(
    "match, k, passes, accepted_at, reached_at",
    [
        # every draft matches: K accepted + 1 bonus per pass: 10 tokens at K=4 -> passes at 0, 5 (5 tokens each)
        ([1] * 10, 4, 2, [2, 2, 2, 2], [2, 2, 2, 2]),
        # nothing matches: one token per pass
        ([0] * 5, 4, 5, [0, 0, 0, 0], [5, 0, 0, 0]),
        # pass 1 at 0: accept 0,1, reject at 2 -> emit 3 tokens; pass 2 at 3: accept 3..6 (4) + bonus -> 8 total;
        # pass 3 at 8: reject -> 9; pass 4 at 9: accept 9 (last token, runs out) -> 10
        ([1, 1, 0, 1, 1, 1, 1, 0, 0, 1], 4, 4, [3, 2, 1, 1], [4, 2, 2, 1]),
        ([1, 0, 1], 1, 2, [2], [2]),  # K=1: pass at 0 accepts 0 (+ bonus 1); pass at 2 accepts 2
    ],
)
def test_greedy_simulation_matches_hand_count(match, k, passes, accepted_at, reached_at):
    a = simulate(np.asarray(match, dtype=float), k)
    assert a.tokens == len(match)
    assert a.passes == passes
    assert a.accepted == accepted_at
    assert a.reached == reached_at


def test_sampled_simulation_converges_to_the_closed_form():
    # Constant acceptance alpha: tokens per pass = (1 - alpha^(K+1)) / (1 - alpha) on long answers.
    alpha, k = 0.6, 4
    a = simulate(np.full(200_000, alpha), k, np.random.default_rng(0))
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert abs(a.tokens_per_pass - expected) < 0.02
    report = acceptance_report(
        SampleSet.build([[5, 6, 7]], [1], ["c"], [True]), [np.asarray([1.0, 1.0])], k=4, sampled=False)
    assert report["tokens_per_pass"] == 2.0 and report["by_category"] == {"c": 2.0}


# ---- data, vocabulary, batches -------------------------------------------------------------------

def test_draft_vocabulary_is_frequency_ranked_with_forced_tokens_first():
    counts = np.asarray([0, 5, 0, 9, 9, 1, 0, 3], dtype=float)
    ids = draft_vocabulary(counts, 4, always=[2])
    assert ids.tolist() == [2, 3, 4, 1]  # forced EOS, then by count (ties: lower id first)
    cov = coverage(counts, [1, 2, 8])
    assert cov[1] == pytest.approx(9 / 27) and cov[2] == pytest.approx(18 / 27) and cov[8] == pytest.approx(1.0)


def test_collate_weights_answers_prompts_and_masks_padding():
    data = SampleSet.build([[1, 2, 3, 4, 5], [7, 8, 9]], [2, 1], ["a", "b"], [False, True])
    b = collate(data, [0, 1], max_seq_len=16, prompt_weight=0.25)
    # row 0: prompt [1,2], answer [3,4,5]: position t predicts t+1 -> t=0 prompt, t=1..3 answer, t=4 nothing
    assert b.weights[0].tolist() == [0.25, 1.0, 1.0, 1.0, 0.0]
    assert b.is_answer[0].tolist() == [False, True, True, True, False]
    assert b.weights[1].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]  # padding weighs nothing
    assert b.input_ids[1].tolist() == [7, 8, 9, 0, 0]
    # too long: the prompt's beginning is cut, the answer kept
    c = collate(data, [0], max_seq_len=4, prompt_weight=0.25)
    assert c.input_ids[0].tolist() == [2, 3, 4, 5] and c.weights[0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_epoch_batches_cover_every_sample_once_within_budget():
    lengths = np.asarray([5, 17, 3, 40, 8, 8, 21, 2])
    batches = epoch_batches(lengths, batch_tokens=48, max_seq_len=64, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 48 for b in batches)
    assert batches != epoch_batches(lengths, batch_tokens=48, max_seq_len=64, seed=4) or len(batches) == 1


# ---- the loop end to end on a tiny random target (CPU, seconds) ----------------------------------

@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from pipeline.distill.config import DistillConfig
    from pipeline.distill.run import distill
    from pipeline.models.testing import make_tiny_llama

    root = tmp_path_factory.mktemp("distill")
    target = make_tiny_llama(root / "target", vocab_size=96, hidden=32, layers=3, heads=4, kv_heads=2, tie=True,
                             max_position_embeddings=256, seed=5)
    cfg = DistillConfig(
        target=str(target), out=str(root / "out"), heldout_prompts=8, layers=(1, 2), draft_vocab=48,
        gen_tokens=600, chunk_prompts=24, max_new_tokens=12, steps=6, batch_tokens=512, max_seq_len=64,
        warmup_steps=2, eval_every=3, ckpt_every=3, eval_max_new_tokens=8, device="cpu", dtype="float32", seed=1,
    )
    metrics = distill(cfg, progress=lambda msg: None)
    return cfg, metrics, target


def test_distill_runs_end_to_end_and_writes_a_loadable_drafter(distilled):
    cfg, metrics, target = distilled
    out = Path(cfg.out)
    assert metrics["steps"] == 6
    assert [h["step"] for h in metrics["history"]] == [0, 3, 6]  # the learning curve, evaluated as it trains
    assert metrics["selected"] in ("L1", "L2")
    assert set(metrics["final"]) == {"L1", "L2"}
    rep = metrics["final"][metrics["selected"]]["heldout_greedy"]
    assert 1.0 <= rep["tokens_per_pass"] <= cfg.eval_k + 1
    assert json.loads((out / "metrics.json").read_text())["selected"] == metrics["selected"]
    for f in ("config.json", "model.safetensors", "draft_vocab.safetensors", "distill.json"):
        assert (out / f).exists(), f

    from pipeline.compat import check_compatible
    from pipeline.models.loader import load_model

    t, t_tok = load_model(target)
    d, d_tok = load_model(out)
    check_compatible(t.info, t_tok, d.info, d_tok)
    assert d.info.vocab_size == 48 and d.info.input_vocab_size == 96 and len(d.info.output_token_ids) == 48
    assert 2 in d.info.output_token_ids  # EOS is always draftable

    # The runner and the training-time module compute the same logits.
    from pipeline.distill.drafter import load_draft_model

    m = load_draft_model(out)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    d.allocate(2, 32)
    runner_logits = d.forward(ids, torch.zeros(2, dtype=torch.long), torch.arange(2))
    assert torch.allclose(runner_logits, m(ids).float(), atol=1e-4)


def test_distill_resumes_from_its_checkpoint_without_regenerating(distilled):
    from pipeline.distill.run import distill

    cfg, metrics, _ = distilled
    shards = sorted((Path(cfg.out) / "work" / "data").glob("shard_*.npz"))
    stamps = [s.stat().st_mtime_ns for s in shards]
    again = distill(cfg, progress=lambda msg: None)
    assert again["resumed"] and again["steps"] == 6
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # data reused, not regenerated
    assert again["final"][again["selected"]]["heldout_greedy"] == metrics["final"][metrics["selected"]]["heldout_greedy"]


def test_distilled_drafter_keeps_greedy_output_and_drafts_only_its_vocabulary(distilled):
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    cfg, _, target = distilled
    t, tok = load_model(target)
    d, _ = load_model(cfg.out)
    drafter = ModelDrafter(d)
    engine = SpeculativeEngine(t, tok, drafter, EngineConfig(max_batch_size=2, max_seq_len=96))
    plain = SpeculativeEngine(load_model(target)[0], tok, None, EngineConfig(max_batch_size=2, max_seq_len=96))
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        prompt = torch.randint(3, 96, (10,), generator=g).tolist()
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        spec = engine.generate(prompt, params, SpecParams(4))
        assert spec.token_ids == plain.generate(prompt, params, SpecParams(0)).token_ids
        assert spec.stats["target_passes"] < 20 or spec.stats["accepted"] == 0
    # Sampled drafting: every proposed token and every shipped probability is over the draft vocabulary.
    from pipeline.drafters import DraftRequest
    from pipeline.sampling import SamplingTensors

    vocab = set(d.info.output_token_ids)
    rows = [DraftRequest("r", torch.randint(3, 96, (6,), generator=g).tolist(), 4)]
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=3)], device="cpu")
    block = drafter.propose(rows, 4, sampling, torch.zeros(1, dtype=torch.long), draft_top_k=64)
    assert set(block.token_ids.flatten().tolist()) <= vocab
    assert set(block.top_ids.flatten().tolist()) <= vocab | {0}
    assert torch.allclose(block.top_probs.sum(-1), torch.ones(1, 4))


def test_hf_assistant_wrapper_scatters_to_target_ids(distilled):
    from pipeline.distill.drafter import load_draft_model, load_hf_assistant

    cfg, _, _ = distilled
    hf = load_hf_assistant(cfg.out)
    m = load_draft_model(cfg.out)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    full = hf(input_ids=ids).logits  # [1, 7, 96]
    assert full.shape[-1] == 96 and hf.config.vocab_size == 96
    assert torch.allclose(full[..., m.token_ids], m(ids), atol=1e-5)
    outside = torch.ones(96, dtype=torch.bool)
    outside[m.token_ids] = False
    assert (full[..., outside] == torch.finfo(full.dtype).min).all()


def test_the_target_as_its_own_drafter_scores_k_plus_one(distilled):
    """The measurement is sound: drafting with the target itself accepts everything (greedy) and
    alpha = 1 (sampled), so a pass emits K+1 tokens except where an answer runs out."""
    from transformers import AutoModelForCausalLM

    from pipeline.distill.drafter import DraftModel
    from pipeline.distill.evaluate import evaluate
    from pipeline.distill.generate import generate_chunk
    from pipeline.distill.prompts import synthetic_prompts

    _, _, target = distilled
    lm = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = synthetic_prompts(6, 96, seed=9, special=[2])
    kw = dict(max_new_tokens=21, eos_ids=[2], pad_id=2, batch_tokens=4096, max_batch=8)
    greedy = generate_chunk(lm, prompts, seed=1, sample_fraction=0.0, sample_temperature=0.7, **kw)
    sampled = generate_chunk(lm, prompts, seed=2, sample_fraction=1.0, sample_temperature=0.7, **kw)
    self_draft = DraftModel(lm, None, 96)
    rep = evaluate(self_draft, {"g": (greedy, 0.0), "s": (sampled, 0.7)}, target=lm, k=4, top_k=96)
    for name, data in (("g", greedy), ("s", sampled)):
        r = rep[name]
        assert r["per_token_accept"] == pytest.approx(1.0, abs=1e-4)
        assert all(a == pytest.approx(1.0, abs=1e-4) for a in r["accept_by_position"] if a is not None)
        n = data.lengths - data.prompt_lens  # an answer of n tokens takes ceil(n / (K+1)) passes
        assert r["tokens_per_pass"] == pytest.approx(n.sum() / np.ceil(n / 5).sum(), abs=1e-3)


def test_cli_registers_distill_with_its_flags():
    import argparse

    from specserve.cmd_distill import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["distill", "--out", "x", "--layers", "1,2,4", "--draft-vocab", "4096", "--device", "cpu"])
    cfg = config_from_args(args)
    assert cfg.layers == (1, 2, 4) and cfg.draft_vocab == 4096 and cfg.dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "--out", "x", "--layers", "two"])


# ---- the shipped drafter -------------------------------------------------------------------------

def test_shipped_drafter_is_small_and_documented():
    files = {p.name: p.stat().st_size for p in SHIPPED.iterdir()}
    assert sum(files.values()) < 30 * 2**20, files
    assert {"config.json", "model.safetensors", "draft_vocab.safetensors", "distill.json"} <= set(files)
    prov = (SHIPPED.parent / "PROVENANCE.md").read_text()
    assert "specserve distill" in prov and "spec_bench_dev" in prov


@pytest.mark.slow
def test_shipped_drafter_loads_is_compatible_and_keeps_greedy_output(demo_path):
    from pipeline.compat import check_compatible
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    t, tok = load_model(demo_path)
    d, d_tok = load_model(SHIPPED)
    check_compatible(t.info, tok, d.info, d_tok)
    assert d.info.input_vocab_size == t.info.vocab_size and d.info.vocab_size == 8192
    engine = SpeculativeEngine(t, tok, ModelDrafter(d), EngineConfig(max_batch_size=1, max_seq_len=512))
    prompts = ["Translate German to English: Der Hund schläft im Garten.", "What is the capital of France?"]
    accepted = 0
    for text in prompts:
        ids = engine.encode(text, chat=True)
        params = SamplingParams(max_tokens=32)
        engine.drafter = ModelDrafter(d)
        spec = engine.generate(ids, params, SpecParams(4))
        engine.drafter = None
        plain = engine.generate(ids, params, SpecParams(0))
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats["accepted"]
    assert accepted > 0  # the drafter is trained: some drafts are accepted
