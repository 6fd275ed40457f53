"""GPU checks of token trees on the captured path (skipped without CUDA): tree verify calls captured and replayed
against the eager runner's tree attention (float32 with both attentions; bfloat16 on the fused layer at batch 1),
`compact` (one gather and one scatter over the cache block) and the steps after it, and greedy tree speculation on
CUDA graphs equal to target-only decoding token for token."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import replace

import pytest
import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams, TreeConfig
from pipeline.drafters import ModelDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.shapes import SHAPES, random_llama
from pipeline.models.tree_attention import TreeMask, compact_indices
from pipeline.tree import tree_shape
from tests.support.decode_attention_cases import compare_tree_calls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HAS_TRITON = importlib.util.find_spec("triton") is not None
ATTENTIONS = [pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")), "sdpa"]
TINY = replace(SHAPES["llama-1b"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
               vocab_size=128)
SMALL = replace(SHAPES["llama-1b"], n_layers=4, vocab_size=4096)  # 1B-shaped layers, fewer, a smaller vocabulary


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("window", [None, 9])
def test_captured_tree_calls_equal_eager_float32(attention, window):
    """Three rows of different trees (T = 5 and 7, a padding row), captured then replayed, `compact` captured,
    a chain step after it: the eager runner's logits in float32; the tree mask is in force."""
    args = replace(TINY, sliding_window=window)
    cfg = GraphConfig(batch_buckets=(1, 2, 4), attention=attention)
    models = {"graph": GraphCausalLM(random_llama(args, "cuda", torch.float32, seed=5), cfg),
              "eager": random_llama(args, "cuda", torch.float32, seed=5)}
    err, argmax_equal, tree_effect = compare_tree_calls(torch, models, "graph", ("eager",))
    graph = models["graph"]
    assert err < 1e-3 and argmax_equal and tree_effect > 0.1, (err, tree_effect)
    assert graph.stats.captures >= 4, graph.stats
    err2, argmax_equal2, _ = compare_tree_calls(torch, models, "graph", ("eager",))  # every graph replayed
    assert err2 < 1e-3 and argmax_equal2


@pytest.mark.parametrize("nodes", [4, 12, 24])
def test_fused_layer_tree_verify_bf16_batch_1(nodes):
    """A 1B-layer model in bfloat16 at batch 1 (the fused layer up to 16 rows, the unfused past it): a tree of
    `nodes` nodes verified on the captured path is as close to float32 as the eager bf16 tree pass is."""
    graph = GraphCausalLM(random_llama(SMALL, "cuda", torch.bfloat16, seed=3))
    eager = random_llama(SMALL, "cuda", torch.bfloat16, seed=3)
    exact = random_llama(SMALL, "cuda", torch.float32, seed=3)
    g = torch.Generator().manual_seed(nodes)
    prompt = torch.randint(0, SMALL.vocab_size, (1, 300), generator=g).cuda()
    for m in (graph, eager, exact):
        m.allocate(2, 512)
        m.forward(prompt, torch.tensor([0]), torch.tensor([0]), 299)
    shape = tree_shape(TreeConfig((4, 3, 2, 2, 1), max_nodes=nodes))
    parents = torch.tensor([[-1] + [p + 1 for p in shape.parents]])
    for _ in range(2):  # capture, replay
        tokens = torch.randint(0, SMALL.vocab_size, (1, nodes + 1), generator=g).cuda()
        tree = TreeMask(parents.cuda())
        got, want, ref = (m.forward(tokens, torch.tensor([300]), torch.tensor([0]), tree=tree)
                          for m in (graph, eager, exact))
        assert _rel(got, want) < 3e-2 and _rel(got, ref) < 1.5 * _rel(want, ref) + 2e-3, (_rel(got, ref),
                                                                                           _rel(want, ref))
    assert graph.stats.graph_calls == 2 and (graph.stats.fused_runs > 0) == (nodes + 1 <= 16)
    # the accepted path (the deepest node's) moved by the captured compact, then a decode step
    node, path = nodes - 1, []
    while node >= 0:
        path.append(node)
        node = shape.parents[node]
    path = torch.tensor([path[::-1]])
    src, dst = compact_indices(torch.tensor([301]), path)
    for m in (graph, eager, exact):
        m.compact(torch.tensor([0]), src, dst)
    nxt = torch.randint(0, SMALL.vocab_size, (1, 1), generator=g).cuda()
    pos = torch.tensor([301 + path.shape[1]])
    got, want, ref = (m.forward(nxt, pos, torch.tensor([0])) for m in (graph, eager, exact))
    assert _rel(got, ref) < 1.5 * _rel(want, ref) + 2e-3


@pytest.mark.parametrize("tree", [TreeConfig((3, 2, 1)), TreeConfig((4, 3, 2, 2, 1), max_nodes=24)],
                         ids=["3x2x1", "budget-24"])
def test_greedy_tree_speculation_on_cuda_graphs_equals_target_only(tree):
    """A draft model drafting trees for a target on CUDA graphs (float32): target-only's tokens, batched and
    alone; the verify passes were graph replays."""
    target = GraphCausalLM(random_llama(TINY, "cuda", torch.float32, seed=5))
    draft = GraphCausalLM(random_llama(dataclasses.replace(TINY, n_layers=1), "cuda", torch.float32, seed=6))
    cfg = EngineConfig(max_batch_size=4, max_seq_len=256, device="cuda")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7]]
    want = [r.token_ids for r in SpeculativeEngine(target, None, None, cfg).generate_batch(prompts, params)]
    replays = target.stats.graph_calls
    engine = SpeculativeEngine(target, None, ModelDrafter(draft), dataclasses.replace(cfg, tree=tree))
    assert [r.token_ids for r in engine.generate_batch(prompts, params, SpecParams(5))] == want
    assert engine.generate(prompts[1], params, SpecParams(5)).token_ids == want[1]
    assert max(engine.timings.steps_by_k) > 5 and target.stats.graph_calls > replays


def test_engine_warmup_captures_the_tree_verify_passes():
    """`SpeculativeEngine.warmup(K)` with a tree drafter also captures the target's tree calls up to the tree's
    nodes + 1 tokens: tree speculation afterwards captures nothing in the target and equals target-only."""
    target = GraphCausalLM(random_llama(TINY, "cuda", torch.float32, seed=5))
    draft = GraphCausalLM(random_llama(dataclasses.replace(TINY, n_layers=1), "cuda", torch.float32, seed=6))
    cfg = EngineConfig(max_batch_size=2, max_seq_len=256, device="cuda")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (40, 50)]  # eager prefills
    want = [r.token_ids for r in SpeculativeEngine(target, None, None, cfg).generate_batch(prompts, params)]
    tree = TreeConfig((3, 2, 1))  # 3 + 6 + 6 = 15 nodes: verify calls of 16 tokens
    engine = SpeculativeEngine(target, None, ModelDrafter(draft), dataclasses.replace(cfg, tree=tree))
    engine.warmup(3)
    assert any(key[-1] == "tree" and key[1] == 16 for key in target._graphs), list(target._graphs)
    before = target.stats.captures
    assert [r.token_ids for r in engine.generate_batch(prompts, params, SpecParams(3))] == want
    assert target.stats.captures == before, target.stats.shapes
