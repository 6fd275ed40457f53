"""The decode/verify attention of the graph path (`pipeline.models.decode_attention`).

The SDPA reference against a per-row loop (always), the dispatch and split planning (always), and the Triton
split-KV kernel against the reference under Triton's CPU interpreter (skipped without triton): the kernel
cases run in one child process with TRITON_INTERPRET=1 (tests/support/decode_attention_cases.py says why), ragged
positions, slots in arbitrary order, a padding row on the scratch slot, T in {1, 5}, G in {1, 3, 4, 8},
window on/off (and attention sinks), S not a multiple of the chunk, float32/bf16/fp16, plus a tiny model's static
path with attention='triton' against 'sdpa' and the eager runner. The GPU checks are in tests/gpu/test_gpu_graphs.py and
ops/check_decode_attention.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from pipeline.models import decode_attention as da
from tests.support import ROOT
from tests.support import decode_attention_cases as cases
from tests.support.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _loop_reference(q, k_cache, v_cache, slots, pos, S, scale, window, sinks=0):
    """Row by row, head by head, query by query: the mask semantics spelled out."""
    B, Hkv, GT, D = q.shape
    T = pos.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(Hkv):
            for m in range(GT):
                p = int(pos[b, m % T])
                lo = 0 if window is None else max(0, p - window + 1)
                kept = sorted(set(range(min(sinks, lo))) | set(range(lo, p + 1)))  # sinks, then lo..p (p < S)
                keys = k_cache[slots[b], h, kept]
                w = torch.softmax(keys @ q[b, h, m] * scale, dim=0)
                out[b, h, m] = w @ v_cache[slots[b], h, kept]
    return out


@pytest.mark.parametrize("window, sinks", [(None, 0), (4, 0), (4, 2), (6, 9)])
def test_sdpa_reference_matches_a_per_row_loop(window, sinks):
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 5, 2, 40, 16, generator=g, dtype=torch.float64)
    slots = torch.tensor([3, 0, 4])  # row 2 plays the scratch slot: position 0 only
    pos = torch.tensor([20, 3, 0])[:, None] + torch.arange(3)  # T = 3
    q = torch.randn(3, 2, 2 * 3, 16, generator=g, dtype=torch.float64)  # G = 2
    got = da.sdpa_slot_attention(q, k_cache, v_cache, slots, pos, 32, 0.25, window, sinks=sinks)
    torch.testing.assert_close(got, _loop_reference(q, k_cache, v_cache, slots, pos, 32, 0.25, window, sinks))


def test_resolve_attention(monkeypatch):
    cpu = torch.device("cpu")
    assert da.resolve_attention("auto", cpu) == "sdpa"
    assert da.resolve_attention("sdpa", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of"):
        da.resolve_attention("flash", cpu)
    monkeypatch.setattr(da, "triton_available", lambda: False)
    assert da.resolve_attention("auto", torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="needs the triton package"):
        da.resolve_attention("triton", cpu)


def test_importing_the_graph_path_does_not_import_triton():
    code = "import sys, pipeline.models.graphs, pipeline.models.decode_attention; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("S, programs, sms", [(768, 8, 132), (768, 128, 132), (4096, 512, 132), (200, 8, 8),
                                              (64, 8, 132), (1000, 1, 132)])
def test_plan_splits_covers_the_keys(S, programs, sms):
    splits, chunk = da.plan_splits(S, programs, 64, sms)
    assert chunk % 64 == 0 and chunk >= 128 or splits == 1
    assert (splits - 1) * chunk < S <= splits * chunk  # every split has keys; together they cover [0, S)
    if programs >= 2 * sms:
        assert splits == 1  # a large batch fills the GPU alone: no combine kernel
    assert splits * programs <= max(4 * sms, programs)


@pytest.fixture(scope="module")
def interpreted_results():
    return run_interpreted(cases.__file__)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
@pytest.mark.parametrize("case", [c[0] for c in cases.KERNEL_CASES] + cases.GRAPH_CASES)
def test_triton_kernel_matches_reference_in_the_interpreter(interpreted_results, case):
    r = interpreted_results[case]
    assert "error" not in r, r["error"]
    assert r["ok"] and r["err"] <= r["tol"], r


def test_auto_attention_falls_back_to_sdpa_when_the_kernel_fails(caplog):
    """A runner whose 'auto' attention resolved to Triton but whose kernel cannot run (here: CPU tensors outside
    the interpreter, or no triton at all) answers with SDPA attention and says so; an explicit 'triton' raises."""
    from dataclasses import replace

    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import SHAPES, random_llama

    args = replace(SHAPES["llama-1b"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=64, vocab_size=64)
    cfg = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2), token_buckets=(1, 2), kv_block=16)
    eager = random_llama(args, "cpu", torch.float32, seed=1)
    eager.allocate(2, 32)
    tokens, positions, slots = torch.tensor([[3, 5]]), torch.tensor([0]), torch.tensor([1])
    want = eager.forward(tokens, positions, slots)

    graph = GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=1), cfg)
    graph.allocate(2, 32)
    graph.attention = "triton"  # as 'auto' resolves on CUDA with triton installed
    with caplog.at_level("WARNING"):
        got = graph.forward(tokens, positions, slots)
    assert graph.attention == "sdpa" and "using SDPA attention" in caplog.text
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    explicit = GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=1), replace(cfg, attention="sdpa"))
    explicit.allocate(2, 32)
    explicit.attention = "triton"  # config says 'sdpa', not 'auto': errors surface
    with pytest.raises((RuntimeError, ImportError)):
        explicit.forward(tokens, positions, slots)
