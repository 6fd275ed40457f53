"""`specserve distill`: the loop end to end on a tiny random target, its parts, and the shipped drafter."""

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
from tests.support import ROOT

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
    from tests.support.models import make_tiny_llama

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
    assert (again["final"][again["selected"]]["heldout_greedy"]
            == metrics["final"][metrics["selected"]]["heldout_greedy"])


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
    from pipeline.drafters import ProposeRow
    from pipeline.sampling import SamplingTensors

    vocab = set(d.info.output_token_ids)
    rows = [ProposeRow("r", torch.randint(3, 96, (6,), generator=g).tolist(), 4)]
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
    assert cfg.gen_backend == "runner" and cfg.gen_graphs is None and cfg.wall_seconds is None
    args = parser.parse_args(["distill", "--out", "x", "--gen-backend", "hf", "--gen-rows", "256",
                              "--gen-graphs", "off", "--gen-attention", "sdpa", "--wall-seconds", "500",
                              "--device", "cpu"])
    cfg = config_from_args(args)
    got = (cfg.gen_backend, cfg.gen_rows, cfg.gen_graphs, cfg.gen_attention, cfg.wall_seconds)
    assert got == ("hf", 256, False, "sdpa", 500)
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "--out", "x", "--layers", "two"])


# ---- the runner backend: continuous batching on this project's runner (fastgen.py) ----------------

@pytest.fixture(scope="module")
def gen_target(tmp_path_factory):
    """A tiny random target, its HF model, ragged prompts, and EOS ids that end some answers early."""
    import random

    from transformers import AutoModelForCausalLM

    from pipeline.distill.generate import generate_answers
    from tests.support.models import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("gen") / "t", vocab_size=96, hidden=32, layers=2, heads=4,
                           kv_heads=2, tie=True, max_position_embeddings=256, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 96) for _ in range(rng.randint(1, 30))] for _ in range(13)]
    free = generate_answers(hf, prompts, max_new_tokens=16, temperature=0.0, eos_ids=[2], pad_id=0,
                            batch_tokens=1 << 20, max_batch=64, seed=0)
    counts = np.bincount([t for a in free for t in a], minlength=96)
    eos = [2, int(np.argsort(-counts, kind="stable")[2])]  # a frequent token as a second EOS
    return path, hf, prompts, eos


def _runner_gen(path, rows, graphs=False, refill_min=None, max_len=96):
    from pipeline.distill.fastgen import RunnerGenerator
    from pipeline.models.loader import load_model

    runner, _ = load_model(path)
    return RunnerGenerator.wrap(runner, rows=rows, max_len=max_len, graphs=graphs, compile=False, refill_min=refill_min)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_runner_backend_greedy_equals_hf_generate(gen_target, graphs):
    """13 ragged prompts (1-30 tokens) through 4 or 5 rows: rows end at EOS or max_new_tokens and are refilled
    (one at a time, or once 3 are free); the answers are HF generate(do_sample=False)'s."""
    from pipeline.distill.fastgen import Job
    from pipeline.distill.generate import generate_answers

    path, hf, prompts, eos = gen_target
    ref = generate_answers(hf, prompts, max_new_tokens=16, temperature=0.0, eos_ids=eos, pad_id=0,
                           batch_tokens=1 << 20, max_batch=64, seed=0)
    lengths = [len(a) for a in ref]
    assert min(lengths) < 16 and max(lengths) == 16 and any(a[-1] == eos[1] for a in ref)  # both endings occur
    for rows, refill in ((4, 1), (5, 3)):
        gen = _runner_gen(path, rows, graphs=graphs, refill_min=refill)
        out = gen.answers([Job(p, 0.0, 0) for p in prompts], max_new_tokens=16, eos_ids=eos)
        assert out == ref, (rows, refill)
        st = gen.stats[-1]
        assert st["jobs"] == len(prompts) and st["prefill_calls"] > 1 and st["decode_tokens"] == sum(lengths)
        assert st["steps"] < sum(lengths)  # rows decoded together


def test_runner_backend_sampling_is_seeded_and_follows_the_warped_target(gen_target):
    """Sampled answers are a function of (seed, logits) only: the same with 3 or 7 rows; other seeds differ;
    the first token is the inverse-CDF draw from softmax(logits / T) with the job's counter-based uniform."""
    from pipeline.distill.fastgen import Job, job_seed
    from pipeline.rng import Stream, uniform
    from pipeline.sampling import sample_from_probs

    path, hf, prompts, eos = gen_target
    jobs = [Job(p, 0.7, job_seed(11, i, 0)) for i, p in enumerate(prompts)]
    a3 = _runner_gen(path, 3).answers(jobs, max_new_tokens=12, eos_ids=eos)
    a7 = _runner_gen(path, 7, refill_min=1).answers(jobs, max_new_tokens=12, eos_ids=eos)
    assert a3 == a7
    other = _runner_gen(path, 3).answers([Job(j.ids, 0.7, j.seed + 1) for j in jobs], max_new_tokens=12, eos_ids=eos)
    assert other != a3
    greedy = _runner_gen(path, 3).answers([Job(j.ids, 0.0, j.seed) for j in jobs], max_new_tokens=12, eos_ids=eos)
    assert greedy != a3
    with torch.no_grad():
        for j, a in zip(jobs, a3):
            logits = hf(input_ids=torch.tensor([j.ids])).logits[0, -1].float()
            u = uniform(torch.tensor([j.seed]), torch.tensor([0]), Stream.TARGET, 1)[:, 0]
            assert a[0] == int(sample_from_probs(torch.softmax(logits / 0.7, -1)[None], u)[0])


def test_runner_chunk_keeps_the_data_semantics_of_the_hf_path(gen_target):
    """generate_chunk on the runner: the same SampleSet as the HF path when greedy (first turns, then
    follow-ups asked after the target's own answer), the same seeded greedy/sampled split, reproducible."""
    from pipeline.distill.generate import generate_chunk
    from pipeline.distill.prompts import synthetic_prompts

    path, hf, _, eos = gen_target
    prompts = synthetic_prompts(10, 96, seed=4, special=[2])  # every 4th has a follow-up
    kw = dict(sample_temperature=0.7, max_new_tokens=10, eos_ids=eos, pad_id=0, batch_tokens=1 << 20, max_batch=64)
    gen = _runner_gen(path, 4)
    a = generate_chunk(hf, prompts, seed=3, sample_fraction=0.0, **kw)
    b = generate_chunk(gen, prompts, seed=3, sample_fraction=0.0, **kw)
    assert len(b) == 10 + 3
    for f in ("ids", "offsets", "prompt_lens", "category", "sampled"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    a = generate_chunk(hf, prompts, seed=3, sample_fraction=0.5, **kw)
    b = generate_chunk(gen, prompts, seed=3, sample_fraction=0.5, **kw)
    assert np.array_equal(a.sampled, b.sampled) and 0 < b.sampled.sum() < len(b)
    greedy = [i for i in range(len(a)) if not a.sampled[i]]
    assert all(np.array_equal(a.seq(i), b.seq(i)) for i in greedy)
    again = generate_chunk(_runner_gen(path, 6), prompts, seed=3, sample_fraction=0.5, **kw)
    assert np.array_equal(again.ids, b.ids) and np.array_equal(again.offsets, b.offsets)


def test_runner_dataset_streams_chunks_into_resumable_shards(gen_target, tmp_path):
    """One stream over the chunks: each shard is what generate_chunk gives for that chunk, a rerun reuses the
    shards, and a token budget keeps the shards a rerun would load."""
    from pipeline.distill.generate import SampleSet, generate_chunk, generate_dataset
    from pipeline.distill.prompts import synthetic_prompts

    path, _, _, eos = gen_target
    prompts = synthetic_prompts(17, 96, seed=6, special=[2])
    kw = dict(sample_fraction=0.5, sample_temperature=0.7, max_new_tokens=8, eos_ids=eos, pad_id=0,
              batch_tokens=1 << 20, max_batch=64)
    data = generate_dataset(_runner_gen(path, 4), prompts, tmp_path / "d", chunk_prompts=5, token_budget=10**9,
                            seconds_budget=None, seed=2, progress=lambda m: None, **kw)
    shards = sorted((tmp_path / "d").glob("shard_*.npz"))
    assert len(shards) == 4 and len(data) == sum(len(SampleSet.load(s)) for s in shards)
    for c, s in enumerate(shards):
        one = generate_chunk(_runner_gen(path, 3), prompts[5 * c : 5 * c + 5], seed=2 + c, **kw)
        assert np.array_equal(SampleSet.load(s).ids, one.ids), c
    stamps = [s.stat().st_mtime_ns for s in shards]
    again = generate_dataset(_runner_gen(path, 4), prompts, tmp_path / "d", chunk_prompts=5, token_budget=10**9,
                             seconds_budget=0.0, seed=2, progress=lambda m: None, **kw)
    assert [s.stat().st_mtime_ns for s in shards] == stamps and np.array_equal(again.ids, data.ids)
    first = SampleSet.load(shards[0]).response_tokens
    small = generate_dataset(_runner_gen(path, 4), prompts, tmp_path / "d", chunk_prompts=5, token_budget=first,
                             seconds_budget=None, seed=2, progress=lambda m: None, **kw)
    assert small.response_tokens == first
    with pytest.raises(RuntimeError, match="no distillation data"):
        generate_dataset(_runner_gen(path, 4), prompts, tmp_path / "e", chunk_prompts=5, token_budget=10**9,
                         seconds_budget=0.0, seed=2, progress=lambda m: None, **kw)


def test_runner_self_check_compares_the_static_step_with_the_eager_runner(gen_target):
    path, _, prompts, _ = gen_target
    gen = _runner_gen(path, 4, graphs=True)
    check = gen.self_check([list(range(3, 60))] * 3, length=16)
    assert check["ok"] and check["checked"] == 3 and check["rel_err"] < 1e-4 and check["argmax_agree"] == 1.0
    assert _runner_gen(path, 4).self_check(prompts)["static"] is False


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
