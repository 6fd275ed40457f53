"""The feature cache of head training (pipeline/distill/head_features.py) and resumption of `train_head`, on a tiny
random target (CPU, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.distill.config import DistillConfig
from pipeline.distill.generate import SampleSet
from pipeline.distill.head_features import FeatureCache, target_features
from pipeline.distill.heads import build_head, head_loss, train_head
from pipeline.distill.target import load_target
from pipeline.distill.train import collate, epoch_batches
from tests.support.models import make_tiny_llama

V = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("hf") / "t", vocab_size=V, hidden=32, layers=6, heads=4,
                             kv_heads=2, tie=True, seed=3)
    model, _, _ = load_target(str(folder), "cpu", "float32", need_tokenizer=False)
    return folder, model


def _data(n: int = 12, seed: int = 0) -> SampleSet:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, V, size=int(rng.integers(10, 30))).tolist() for _ in range(n)]
    return SampleSet.build(seqs, [max(2, len(s) // 3) for s in seqs], ["a"] * n, [False] * n)


def _cfg(folder, method: str, **kw) -> DistillConfig:
    base = dict(target=str(folder), out="unused", method=method, draft_vocab=32, batch_tokens=128, max_seq_len=64,
                steps=6, warmup_steps=2, lr=3e-3, eval_every=100, ckpt_every=100, log_every=2, device="cpu",
                dtype="float32", head_depth=3, medusa_heads=3, teacher_topk=V, seed=2)
    return DistillConfig(**{**base, **kw})


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_cached_features_give_the_loss_of_a_fresh_target_pass(target, method):
    """The loss on a batch read back from the cache equals cross-entropy to the target's own distribution (restricted
    to the head's rows, renormalised), computed from a fresh forward of the HF model with its output layer."""
    folder, model = target
    cfg = _cfg(folder, method)
    rows = torch.arange(0, V, 2) if method == "eagle3" else None
    torch.manual_seed(0)
    head = build_head(cfg, model, rows)
    for p in head.parameters():  # away from the initialisation (Medusa's blocks start at zero)
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else torch.nn.init.normal_(p, 1.0, 0.05)
    data = _data()
    batches = epoch_batches(data.lengths, cfg.batch_tokens, cfg.max_seq_len, cfg.seed)
    layers = head.cfg.layers_for(6) if method == "eagle3" else None

    def make(i: int):
        b = collate(data, batches[i], cfg.max_seq_len, cfg.prompt_weight)
        return target_features(model, b.input_ids, b.weights, layers, rows, cfg.teacher_topk)

    cache = FeatureCache(make, torch.device("cpu"), device_bytes=0, host_bytes=1e9)  # the host tier
    cache.get(0)
    cached = cache.get(0)
    assert cache.computed == 1 and cache.stats()["batches"] == 1
    loss, stats = head_loss(head, cached, cfg.head_depth)

    # The reference: a fresh, uncached pass of the whole HF model, the loss written out in plain torch.
    b = collate(data, batches[0], cfg.max_seq_len, cfg.prompt_weight)
    ids, w = b.input_ids, b.weights
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    logits_t = out.logits if rows is None else out.logits[..., rows]
    teacher = logits_t.float().softmax(-1)  # [B, T, V']
    if method == "eagle3":
        feats = torch.cat([out.hidden_states[i] for i in layers], -1)
        outs = head.train_forward(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1), feats, cfg.head_depth)
    else:
        hidden = head.hidden(out.hidden_states[-1])
        outs = [head.logits(hidden[..., i, :], i) for i in range(head.num_heads)]
    ref = []
    for d, lg in enumerate(outs):
        T = ids.shape[1]
        wd = torch.zeros_like(w)
        wd[:, : T - 1 - d] = w[:, 1 + d:]
        td = torch.zeros_like(teacher)
        td[:, : T - 1 - d] = teacher[:, 1 + d:]
        ce = -(td * F.log_softmax(lg.float(), -1)).sum(-1)
        ref.append((wd * ce).sum() / wd.sum())
    torch.testing.assert_close(stats[: cfg.head_depth], torch.stack(ref).detach(), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(loss, torch.stack(ref).mean(), atol=2e-3, rtol=1e-3)


def test_teacher_topk_keeps_the_targets_argmax_first(target):
    folder, model = target
    data = _data(4)
    b = collate(data, [0, 1, 2, 3], 64, 0.1)
    hb = target_features(model, b.input_ids, b.weights, None, None, 4)
    with torch.no_grad():
        top = model(input_ids=b.input_ids).logits.argmax(-1)
    assert hb.teacher_idx.shape[-1] == 4 and torch.equal(hb.teacher_idx[..., 0].long(), top)
    torch.testing.assert_close(hb.teacher_logp.float().exp().sum(-1), torch.ones(top.shape), atol=2e-3, rtol=0)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_resumed_training_continues_identically(target, method, tmp_path):
    """Interrupted after 3 of 6 steps and resumed from the checkpoint: the same weights and optimizer state as a
    run of 6 steps straight (the batch order, the schedule and the optimizer are all restored)."""
    folder, model = target
    cfg = _cfg(folder, method)
    rows = torch.arange(0, V, 2) if method == "eagle3" else None
    data = _data(24, seed=1)
    quiet = dict(progress=lambda msg: None)
    straight, s_state = train_head(cfg, model, data, rows, {}, tmp_path / "a", torch.device("cpu"), **quiet)
    _, first = train_head(cfg, model, data, rows, {}, tmp_path / "b", torch.device("cpu"), stop_at=3, **quiet)
    assert first["step"] == 3
    resumed, r_state = train_head(cfg, model, data, rows, {}, tmp_path / "b", torch.device("cpu"), **quiet)
    assert s_state["step"] == r_state["step"] == 6
    assert s_state["answer_tokens"] == r_state["answer_tokens"] > 0
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)
    ck_a = torch.load(tmp_path / "a" / "head_checkpoint.pt", weights_only=False)["opt"]["state"]
    ck_b = torch.load(tmp_path / "b" / "head_checkpoint.pt", weights_only=False)["opt"]["state"]
    for k in ck_a:
        torch.testing.assert_close(ck_a[k]["exp_avg"], ck_b[k]["exp_avg"], atol=0, rtol=0)
    assert [r["loss"] for r in s_state["log"]][-1] == [r["loss"] for r in r_state["log"]][-1]


def test_a_finished_timed_run_started_again_trains_another_budget(target, tmp_path):
    folder, model = target
    cfg = _cfg(folder, "eagle3", train_seconds=1.0)
    data, rows, quiet = _data(24, seed=1), torch.arange(0, V, 2), dict(progress=lambda msg: None)
    _, first = train_head(cfg, model, data, rows, {}, tmp_path, torch.device("cpu"), **quiet)
    assert first["done"] and first["step"] > 0 and first["elapsed"] >= 1.0
    _, again = train_head(cfg, model, data, rows, {}, tmp_path, torch.device("cpu"), **quiet)
    assert again["done"] and again["step"] > first["step"] and again["cycle_step"] == first["step"]
    assert again["elapsed"] >= first["elapsed"] + 1.0
