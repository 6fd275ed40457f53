"""GPU checks of the graph path on the other families (skipped without CUDA): tiny random-weight Qwen3, Gemma 2 and
Gemma 3 models saved by transformers (`tests.support.families`: sliding window 16, which the calls pass), loaded as
a checkpoint is. Float32 captured graphs (Triton attention with each layer's window and soft-cap, per-layer RoPE
bases) against HF's logits to the CPU tests' tolerance; bf16 captured graphs with the fused layer as close to
float32 as the bf16 eager runner is; greedy speculative decoding on graphs equal to the eager target's tokens."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.loader import load_model
from pipeline.models.shapes import SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
transformers = pytest.importorskip("transformers")

HAS_TRITON = importlib.util.find_spec("triton") is not None
ATTENTIONS = [pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")), "sdpa"]
FAMILIES = ("qwen3", "gemma2", "gemma3")
VOCAB = 96  # tests.support.families' vocabulary


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    from tests.support.families import make_tiny_family

    root = tmp_path_factory.mktemp("gpu-families")
    made = {}

    def get(family: str) -> str:
        if family not in made:  # 64 wide: the fused layer's tiles see more than one block of columns
            made[family] = str(make_tiny_family(root / family, family, hidden=64))
        return made[family]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_float32_graph_logits_equal_hf(family_dir, family, attention):
    """The captured float32 path through a ragged prefill, multi-token steps and a rollback, past the window:
    HF's logits to 1e-4 (tests/pipeline/models/test_models.py's tolerance)."""
    from tests.pipeline.models.test_models import TOL, check_against_hf

    path = family_dir(family)
    runner, _ = load_model(path, "cuda", "float32")
    graph = GraphCausalLM(runner, GraphConfig(attention=attention))
    # HF's eager attention: its SDPA path (transformers' default on CUDA) leaves out Gemma 2's soft-capping
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = hf.eval()
    assert check_against_hf(graph, hf, VOCAB) < TOL
    assert graph.stats.captures > 0 and graph.stats.graph_calls > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_graph_logits_as_close_to_float32_as_eager(family_dir, family, fused):
    """bf16 captured graphs (the fused layer: `fused`; else the unfused layer with compiled pointwise work) against
    the float32 eager runner (HF's logits to 1e-4 on the CPU tests): as close as the bf16 eager runner, and close to
    it; ragged rows at positions past the window."""
    if fused and not HAS_TRITON:
        pytest.skip("the fused layer needs triton")
    path = family_dir(family)
    graph = GraphCausalLM(load_model(path, "cuda", "bfloat16")[0], GraphConfig(fused_layer=fused))
    assert graph.fused_layer == fused
    eager, _ = load_model(path, "cuda", "bfloat16")
    ref32, _ = load_model(path, "cuda", "float32")
    lengths = [30, 5, 21, 17]
    g = torch.Generator().manual_seed(0)
    for m in (graph, eager, ref32):
        m.allocate(4, 128)
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, VOCAB, (1, n), generator=g).cuda()
        for m in (graph, eager, ref32):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    for B, T in [(1, 1), (1, 5), (3, 1), (3, 5), (4, 4)]:
        for _ in range(2):  # first call captures, second replays
            slots = torch.randperm(len(lengths), generator=g)[:B]
            positions = torch.tensor([lengths[s] for s in slots])
            tokens = torch.randint(0, VOCAB, (B, T), generator=g).cuda()
            got, want, exact = (m.forward(tokens, positions, slots) for m in (graph, eager, ref32))
            assert torch.isfinite(got).all()
            assert _rel(got, want) < 3e-2, (family, B, T, _rel(got, want))
            assert _rel(got, exact) < 1.5 * _rel(want, exact) + 2e-3, (family, B, T, _rel(got, exact),
                                                                         _rel(want, exact))
            for s in slots.tolist():  # all but the first fed token rejected: a row reads only what it wrote (the
                lengths[s] += 1  # graph path's padded prefills leave other entries past a row's end)
    assert graph.stats.captures >= 5 and graph.stats.host_syncs == 0
    assert (graph.stats.fused_runs > 0) == fused


# The families' layers at the greedy test's tiny sizes (tests/gpu/test_gpu_graphs.py), with a window the 128-token
# sequences pass
GREEDY_FAMILIES = {
    "gemma2": replace(SHAPES["gemma2-2b"], sliding_window=16),
    "gemma3": replace(SHAPES["gemma3-4b"], sliding_window=16,
                      sliding_layers=(True, False) + SHAPES["gemma3-4b"].sliding_layers[2:]),
}


@pytest.mark.parametrize("family", list(GREEDY_FAMILIES))
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_greedy_speculative_on_graphs_equals_unbatched_eager_fp32(attention, family):
    from tests.gpu.test_gpu_graphs import greedy_speculative_on_graphs_equals_eager

    greedy_speculative_on_graphs_equals_eager(GREEDY_FAMILIES[family], attention, torch.device("cuda"))
