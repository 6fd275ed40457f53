"""GPU checks of self-speculation (skipped without CUDA): the captured path's StreamingLLM window (the Triton
split-KV kernel reading the sinks and the window only, and the SDPA reference) against the eager runner's mask, in
float32; and greedy output of the engine with the self drafter on captured graphs equal to target-only greedy."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.shapes import SHAPES, random_llama
from pipeline.self_spec import SelfSpecDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = replace(SHAPES["llama-1b"], n_layers=4, vocab_size=4096)
HAS_TRITON = importlib.util.find_spec("triton") is not None
ATTENTIONS = [pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")), "sdpa"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_graph_stream_window_matches_the_eager_mask(attention):
    graph = GraphCausalLM(random_llama(SMALL, "cuda", torch.float32, seed=2), GraphConfig(attention=attention))
    eager = random_llama(SMALL, "cuda", torch.float32, seed=2)
    for m in (graph, eager):
        m.allocate(4, 1024)
    g = torch.Generator().manual_seed(0)
    lengths = [900, 300, 40, 700]  # one row inside the window: the stream changes nothing there
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, SMALL.vocab_size, (1, n), generator=g).cuda()
        for m in (graph, eager):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    for T in (1, 1, 3):  # capture, replay, a verify-sized call
        slots = torch.tensor([0, 1, 2, 3])
        tokens = torch.randint(0, SMALL.vocab_size, (4, T), generator=g).cuda()
        positions = torch.tensor(lengths)
        got = graph.forward(tokens, positions, slots, stream=(64, 4))
        want = eager.forward(tokens, positions, slots, stream=(64, 4))
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        full = eager.forward(tokens, positions, slots)
        assert not torch.allclose(full[0], want[0], atol=1e-3)  # the window is really applied
    assert graph.stats.graph_calls >= 3


def test_self_drafter_on_graphs_greedy_equals_target_only():
    target = random_llama(SMALL, "cuda", torch.float32, seed=3)  # float32: verify and decode numerics agree
    cfg = EngineConfig(max_batch_size=4, max_seq_len=1024, device="cuda", dtype="float32",
                       self_spec_min_context=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist() for n in (600, 200, 900)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = SpeculativeEngine(target, None, None, cfg).generate_batch(prompts, params, SpecParams(0))
    engine = SpeculativeEngine(target, None, SelfSpecDrafter(target, window=64, sinks=4), cfg)
    got = engine.generate_batch(prompts, params, SpecParams(3))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert isinstance(engine.target, GraphCausalLM) and engine.drafter.model.target is engine.target
