"""Self-speculation through a StreamingLLM window (`pipeline.self_spec`), on a tiny random Llama on the CPU.

The window's logits against a layer-by-layer reference that attends to the sinks and the window only; greedy
output equal to target-only greedy with contexts longer than the window (the self drafter alone, and the
automatic per-request choice mixed with prompt lookup); seeded sampled output that replays exactly and does not
depend on what shares the batch; the drafter word and the automatic choice's conditions.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import EngineConfig, SamplingParams, SelfSpec, SpecParams, parse_self
from pipeline.drafters import PromptLookupDrafter, build_drafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.llama import apply_rope
from pipeline.models.shapes import SHAPES, random_llama
from pipeline.self_spec import LongContextDrafter, SelfSpecDrafter, auto_self_spec

VOCAB = 97
ARGS = replace(SHAPES["llama-1b"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
               vocab_size=VOCAB)


def _target(seed: int = 3):
    return random_llama(ARGS, "cpu", torch.float32, seed=seed)


def _prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _windowed_reference(runner, slot: int, token: int, p: int, window: int, sinks: int) -> torch.Tensor:
    """Logits [V] of `token` at position p attending to the cached keys at positions < sinks and in (p - window, p)
    plus its own: each layer by hand, keys gathered from the slot (no mask)."""
    m, a = runner.model, runner.args
    keep = sorted(set(range(min(sinks, p))) | set(range(max(p - window + 1, 0), p)))
    x = m.embed(torch.tensor([[token]]))  # [1, 1, C]
    cos, sin = runner._cos[p][None, None, None], runner._sin[p][None, None, None]  # [1, 1, 1, D]
    for layer, k_cache, v_cache in zip(m.layers, runner.k_caches, runner.v_caches):
        at, h = layer.attention, layer.attention_norm(x)
        q = apply_rope(at.wq(h).view(1, 1, a.n_heads, a.head_dim), cos, sin)[0, 0]  # [H, D]
        k = apply_rope(at.wk(h).view(1, 1, a.n_kv_heads, a.head_dim), cos, sin)[0, 0]  # [Hkv, D]
        v = at.wv(h).view(a.n_kv_heads, a.head_dim)
        keys = torch.cat([k_cache[slot][:, keep], k[:, None]], dim=1)  # [Hkv, n + 1, D]
        values = torch.cat([v_cache[slot][:, keep], v[:, None]], dim=1)
        G = a.n_heads // a.n_kv_heads
        keys, values = keys.repeat_interleave(G, 0), values.repeat_interleave(G, 0)  # [H, n + 1, D]
        weights = F.softmax((keys @ q[:, :, None])[..., 0] * a.head_dim**-0.5, dim=-1)  # [H, n + 1]
        y = (weights[:, None, :] @ values)[:, 0]  # [H, D]
        x = x + at.wo(y.reshape(1, 1, -1))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return m.logits(x)[0, 0]


@pytest.mark.parametrize("window, sinks", [(8, 4), (8, 0), (1, 2), (64, 4)])
def test_streaming_window_logits_match_a_reference_attending_to_the_kept_keys(window, sinks):
    runner = _target()
    runner.allocate(3, 96)
    (prompt,) = _prompts([40])
    runner.forward(torch.tensor([prompt[:-1]]), torch.tensor([0]), torch.tensor([1]))  # the target's prefill
    p = len(prompt) - 1
    want = _windowed_reference(runner, 1, prompt[-1], p, window, sinks)
    got = runner.forward(torch.tensor([[prompt[-1]]]), torch.tensor([p]), torch.tensor([1]),
                         stream=(window, sinks))[0, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = runner.forward(torch.tensor([[prompt[-1]]]), torch.tensor([p]), torch.tensor([1]))[0, 0]
    assert (window + sinks > p) == torch.allclose(full, got, atol=1e-5)  # a window inside the context changes them


def _greedy(engine, prompts, k: int) -> list:
    return engine.generate_batch(prompts, SamplingParams(max_tokens=24, ignore_eos=True), SpecParams(k))


def test_self_drafter_greedy_equals_target_only_greedy_past_the_window():
    target = _target()
    cfg = EngineConfig(max_batch_size=3, max_seq_len=160)
    prompts = _prompts([90, 40, 120])  # all longer than window + sinks
    want = [r.token_ids for r in _greedy(SpeculativeEngine(target, None, None, cfg), prompts, 0)]
    engine = SpeculativeEngine(target, None, build_drafter("self:window=16,sinks=2", target.info, None,
                                                           target=target), cfg)
    results = _greedy(engine, prompts, 4)
    assert [r.token_ids for r in results] == want
    assert sum(r.stats["drafted"] for r in results) > 0
    # A window covering the whole context drafts the target's own tokens: every draft accepted.
    wide = SpeculativeEngine(target, None, SelfSpecDrafter(target, window=200, sinks=0), cfg)
    results = _greedy(wide, prompts, 4)
    assert [r.token_ids for r in results] == want
    assert all(r.stats["acceptance_rate"] == 1.0 for r in results)


def test_long_context_drafter_mixes_per_request_and_stays_exact():
    """Prompts of >= 60 tokens draft with the self drafter, the others with prompt lookup; greedy output is the
    target's, a seeded sampled request gives the same tokens alone and in a mixed batch."""
    target = _target()
    cfg = EngineConfig(max_batch_size=4, max_seq_len=160)
    prompts = _prompts([90, 20, 120, 30], seed=1)
    prompts[1] = prompts[1] + prompts[1]  # something for prompt lookup to find
    want = [r.token_ids for r in _greedy(SpeculativeEngine(target, None, None, cfg), prompts, 0)]

    def engine() -> SpeculativeEngine:
        return SpeculativeEngine(target, None, LongContextDrafter(PromptLookupDrafter(), SelfSpecDrafter(
            target, window=16, sinks=2), min_context=60), cfg)

    mixed = engine()
    assert [r.token_ids for r in _greedy(mixed, prompts, 3)] == want
    assert not mixed.drafter._long  # released
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=20, ignore_eos=True)
               for i in range(4)]
    batch = engine().generate_batch(prompts, sampled, SpecParams(3))
    alone = engine().generate_batch([prompts[0]], sampled[0], SpecParams(3))
    again = engine().generate_batch(prompts, sampled, SpecParams(3))
    assert alone[0].token_ids == batch[0].token_ids
    assert [r.token_ids for r in again] == [r.token_ids for r in batch]


def test_drafter_word():
    assert parse_self("self") == SelfSpec(512, 4)
    assert parse_self("self:window=256") == SelfSpec(256, 4)
    assert parse_self("self:window=128,sinks=0") == SelfSpec(128, 0)
    assert SelfSpec(128, 0).word() == "self:window=128,sinks=0"
    for bad in ("self:", "self:window=", "self:size=4", "self:window=0", "self:window=8,window=9", "selfish"):
        with pytest.raises(ValueError):
            parse_self(bad)
    target = _target()
    drafter = build_drafter("self:window=32,sinks=1", target.info, None, target=target)
    assert isinstance(drafter, SelfSpecDrafter) and (drafter.window, drafter.sinks) == (32, 1)
    with pytest.raises(ValueError, match="the target itself"):
        build_drafter("self", target.info, None)
    with pytest.raises(ValueError, match=r"no 'lookup\+' form"):
        build_drafter("lookup+self", target.info, None, target=target)


def test_automatic_choice_needs_a_gpu_a_large_batch_and_long_contexts(caplog, monkeypatch):
    target, base = _target(), PromptLookupDrafter()
    cfg = EngineConfig(max_batch_size=32, max_seq_len=8192)
    assert auto_self_spec(base, target, cfg) is base  # on the CPU the draft step costs a target step
    monkeypatch.setattr(target, "device", torch.device("cuda"))  # the rule only; nothing runs
    with caplog.at_level(logging.INFO, logger="pipeline.self_spec"):
        chosen = auto_self_spec(base, target, cfg)
    assert isinstance(chosen, LongContextDrafter) and chosen.min_context == cfg.self_spec_min_context
    assert "prompts of >= 6144 tokens draft with self:window=512,sinks=4" in caplog.text
    assert auto_self_spec(base, target, replace(cfg, max_batch_size=16)) is base
    assert auto_self_spec(base, target, replace(cfg, max_seq_len=4096)) is base
    assert auto_self_spec(base, target, replace(cfg, self_spec_min_context=0)) is base
    assert auto_self_spec(None, target, cfg) is None  # target-only stays target-only
    with pytest.raises(ValueError, match="self_spec_min_context"):
        EngineConfig(self_spec_min_context=-1)
    with pytest.raises(ValueError, match="window >= 1"):
        EngineConfig(self_spec_window=0)
