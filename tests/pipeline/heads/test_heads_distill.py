"""`specserve distill --method eagle3|medusa` on a tiny random target (CPU, seconds), and the training-time test."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.heads.eagle3 import Eagle3Config, Eagle3Head
from tests.support.models import make_tiny_llama

V = 96


def test_training_time_test_equals_drafting_over_the_cache():
    """Depth d of `train_forward` at position p is what the head drafts over its cache when it has read the pairs
    up to p and then its own outputs with the true tokens: the training sees its own earlier drafts."""
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       vocab_size=V, draft_vocab_size=V)
    head = Eagle3Head(cfg, torch.randn(V, 32)).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.1)
    T, depth = 10, 3
    tokens, feats = torch.randint(0, V, (1, T)), torch.randn(1, T, 96)
    with torch.no_grad():
        outs = head.train_forward(tokens, feats, depth)
    head.allocate(1, 32)
    slot = torch.zeros(1, dtype=torch.int64)
    for p in (0, 4, 6):
        logits, r = head.step(tokens[:, : p + 1], feats[:, : p + 1], torch.zeros(1, dtype=torch.int64), slot, True)
        torch.testing.assert_close(logits[0, p], outs[0][0, p], atol=1e-4, rtol=1e-4)
        r = r[:, p:]
        for d in range(1, depth):
            logits, r = head.step(tokens[:, p + d: p + d + 1], r, torch.tensor([p + d]), slot, False)
            torch.testing.assert_close(logits[0, 0], outs[d][0, p], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from pipeline.distill.config import DistillConfig
    from pipeline.distill.run import distill

    root = tmp_path_factory.mktemp("heads_distill")
    target = make_tiny_llama(root / "target", vocab_size=V, hidden=32, layers=6, heads=4, kv_heads=2, tie=True,
                             max_position_embeddings=256, seed=5)
    out = {}
    for method in ("eagle3", "medusa"):
        cfg = DistillConfig(
            target=str(target), out=str(root / method), method=method, heldout_prompts=6, draft_vocab=48,
            gen_tokens=500, chunk_prompts=24, max_new_tokens=12, steps=6, batch_tokens=512, max_seq_len=64,
            warmup_steps=2, eval_every=3, ckpt_every=3, eval_max_new_tokens=10, device="cpu", dtype="float32",
            seed=1, head_depth=3, medusa_heads=3, lr=3e-3)
        out[method] = (cfg, distill(cfg, progress=lambda msg: None))
    return target, out


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_distill_trains_a_head_that_loads_and_keeps_the_targets_output(trained, method):
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.distill.generate import SampleSet
    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    target, runs = trained
    cfg, metrics = runs[method]
    out = Path(cfg.out)
    assert metrics["steps"] == 6 and [h["step"] for h in metrics["history"]] == [0, 3, 6]
    assert metrics["history"][-1]["train"]["loss"] > 0
    weights = "model.safetensors" if method == "eagle3" else "medusa_lm_head.safetensors"
    assert (out / "config.json").exists() and (out / weights).exists()
    assert json.loads((out / "metrics.json").read_text())["method"] == method
    rep = metrics["final"]["heldout_greedy"]
    assert 1.0 <= rep["tokens_per_pass"] <= cfg.eval_k + 1

    # The head drafts in the engine; greedy output is the target's, and the teacher-forced figure is the engine's.
    model, tok = load_model(str(target))
    drafter = build_drafter(f"{method}:{out}", model.info, tok, target=model)
    config = EngineConfig(max_batch_size=4, max_seq_len=128)
    heldout = SampleSet.load(out / "work" / "eval_heldout_greedy.npz")
    prompts = [heldout.seq(i)[: heldout.prompt_lens[i]].tolist() for i in range(len(heldout))]
    answers = [heldout.seq(i)[heldout.prompt_lens[i]:].tolist() for i in range(len(heldout))]
    engine = SpeculativeEngine(model, tok, drafter, config)
    results = engine.generate_batch(prompts, [SamplingParams(max_tokens=len(a), ignore_eos=True) for a in answers],
                                    SpecParams(num_draft_tokens=cfg.eval_k))
    plain = SpeculativeEngine(model, tok, None, config)
    for r, p, a in zip(results, prompts, answers):
        assert r.token_ids == plain.generate(p, SamplingParams(max_tokens=len(a), ignore_eos=True)).token_ids
    same = [r for r, a in zip(results, answers) if r.token_ids == a]
    assert len(same) == len(answers)  # the references are the target's own greedy answers
    tokens = sum(len(r.token_ids) for r in results)
    passes = sum(r.stats["target_passes"] for r in results)
    assert (tokens, passes) == (rep["tokens"], rep["passes"])


def test_chain_simulation_counts_passes():
    from pipeline.distill.heads import simulate_chain

    match = np.array([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=bool)
    a = simulate_chain(match, 3)  # pass at 0: depth 0, 1 match, depth 2 not -> 3 tokens; pass at 3: depth 0 -> 2
    assert (a.tokens, a.passes, a.accepted, a.reached) == (5, 2, [2, 1, 0], [2, 2, 1])
