"""The graph path's skinny-linear and fused RoPE/cache-write kernels (`pipeline.models.skinny_linear`,
`pipeline.models.rope_write`).

Always: the configuration planning of the linear kernel, the dispatch ('torch' is F.linear, rows past MAX_ROWS
fall back), and the RoPE reference against the eager model's own attention input. Under Triton's CPU
interpreter (skipped without triton; two child processes with half the cases each, see
tests/support/decode_attention_cases.py for why children): the linear
kernel against F.linear (1 to 40 rows, ragged N and K, bias, 1 to 8 splits, a transposed input, fp32/bf16/
fp16), the fused RoPE/cache write against the reference (GQA, MHA, MQA, T = 1..5, an odd head_dim, and no
write outside the rows' positions), a tiny model's static path with every kernel on against the
reference path and the eager runner, and the fused layer (`pipeline.models.fused_linear`: RMSNorm prologue,
SiLU-gate and residual epilogues, the attention-heads input layout, float32 logits; then a tiny bf16 model,
with q/k/v biases and a sliding window too, with Qwen3's q/k norms, and tiny Gemma 2 and Gemma 3 models: (1 + w)
norms, post norms (`add_norm`), GeGLU, soft-capping, per-layer windows and RoPE bases) against the eager math.
The GPU timings are ops/check_skinny_linear.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pipeline.models import skinny_linear as sl
from pipeline.models.rope_write import torch_rope_write
from tests.support import ROOT
from tests.support import graph_kernel_cases as cases
from tests.support.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("M,N,K,sms", [(1, 4096, 4096, 132), (1, 1536, 4096, 132), (5, 128256, 4096, 132),
                                      (16, 512, 14336, 108), (64, 96, 256, 8)])
def test_configs_cover_the_shape(M, N, K, sms):
    configs = sl.candidates(M, N, K, sms) + [sl.default_config(M, N, K, sms)]
    assert configs
    for c in configs:
        depth = sl._split_depth(K, c.splits, c.block_k)
        assert depth % c.block_k == 0 and depth * c.splits >= K  # the splits cover K in whole tiles
        assert -(-K // depth) <= c.splits
        assert 2 <= c.num_stages <= 4
        per_stage = (c.block_k * c.block_n + sl.m_pad(M) * c.block_k) * 2
        assert c.num_stages * per_stage <= max(sl._SMEM_BUDGET, 2 * per_stage)


def test_default_config_splits_k_only_when_columns_are_few():
    assert sl.default_config(1, 128256, 4096, 132).splits == 1
    small = sl.default_config(1, 1536, 4096, 132)
    assert small.block_n == 16 and small.splits > 1


def test_fused_default_config_follows_the_chain_timings():
    from pipeline.models import fused_linear as fl

    # H100 (132 SMs), the chain's best per linear (ops/linear_chain_bench.py --configs): 32 columns while that
    # still gives 0.7 programs per SM (8B, and 8B q/k/v at TP=2: 3072 columns), else 16 (the 1B's 2048 columns)
    assert fl.default_config(1, 3072, 4096, 132) == fl.FusedConfig(32, 256, 4, 4)
    assert fl.default_config(1, 2048, 8192, 132).block_n == 16
    assert fl.default_config(1, 14336, 4096, 132, gate=True).block_k == 256


def test_one_row_calls_tune_cuda_core_and_tensor_core_products():
    from pipeline.models import fused_linear as fl

    one = fl.tuning_candidates(1, 4096, 14336, 132, False, 2)
    kinds = {c.gemv for c in one}
    assert kinds == {True, False}, "one row: both products are timed"
    assert all(not c.gemv for c in fl.tuning_candidates(2, 4096, 14336, 132, False, 2)), "2+ rows: tensor cores"
    assert fl.gemv_default(4096, 14336, 132).gemv
    assert all(not c.gemv for c in fl.tuning_candidates(1, 4096, 14336, 132, False, 2, use_gemv=False))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="one-row calls"):
        fl._launch(x, 2, 64, (1, 64, 0), (1, 1), w, None, None, 0.0, False, None, None, False,
                   fl.FusedConfig(16, 64, 4, 1, 1, True))


def test_tuning_chains_outgrow_l2():
    from pipeline.models.kernel_timing import copies_needed

    l2 = 50 << 20  # H100
    assert copies_needed(l2, 25 << 20) == 8  # 8B q/k/v at TP=2: 8 x 25 MB = 4x L2
    assert copies_needed(l2, 67 << 20) == 3  # 1B gate/up: 201 MB
    assert copies_needed(l2, 235 << 20) == 1  # 8B gate/up alone is 4.7x L2
    assert copies_needed(l2, 8 << 20) == 8  # 1B's output projection: 64 MB, past L2
    assert copies_needed(l2, 1 << 20) == 8  # capped (said in weight_copies' doc)
    assert copies_needed(l2, 0) == 8 and copies_needed(0, 1 << 20) == 1


@pytest.mark.parametrize("script,bad_args,first_words", [
    ("linear_chain_bench", ["--sets", "9b"], "linear_chain_bench: unknown variant, set or kind '9b'"),
])
def test_gpu_bench_scripts_refuse_in_one_line(script, bad_args, first_words):
    """Bad arguments: one line, exit 2, before any GPU work; without a GPU: one line saying so."""
    import subprocess
    import sys

    root = ROOT
    bad = subprocess.run([sys.executable, "-m", f"ops.{script}", *bad_args], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith(first_words) and "9b" in bad.stderr
    if not torch.cuda.is_available():
        cpu = subprocess.run([sys.executable, "-m", f"ops.{script}"], cwd=root, capture_output=True, text=True,
                             timeout=120)
        assert cpu.returncode == 2 and cpu.stderr.strip() == f"{script}: needs a CUDA GPU"


def test_linear_dispatch():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    torch.testing.assert_close(sl.linear(x, w, b, "torch"), torch.nn.functional.linear(x, w, b))
    many = torch.randn(sl.MAX_ROWS + 1, 8, generator=g)  # past MAX_ROWS: F.linear whatever the kind
    torch.testing.assert_close(sl.linear(many, w, b, "triton"), torch.nn.functional.linear(many, w, b))
    assert sl.resolve_linear("auto", torch.device("cpu")) == "torch"
    # float32 weights never take the kernel under "auto": exactly F.linear (no custom op, no tuning)
    calls = []
    original = sl._choose
    sl._choose = lambda *a: calls.append(a) or original(*a)
    try:
        assert torch.equal(sl.linear(x, w, b, "auto"), torch.nn.functional.linear(x, w, b))
    finally:
        sl._choose = original
    assert calls == []
    with pytest.raises(ValueError, match="linear must be one of"):
        sl.resolve_linear("cublas", torch.device("cpu"))


def _tiny_fused_args():
    from dataclasses import replace

    from pipeline.models.shapes import SHAPES

    return replace(SHAPES["llama-1b"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128)


def test_fused_layer_is_off_by_default_on_cpu_and_refused_without_its_kernels():
    """By default the fused layer is off on CPU (on CUDA it serves batch-1 calls); asked for without the
    Triton attention it is a clear error."""
    from dataclasses import replace

    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import random_llama

    args, base = _tiny_fused_args(), GraphConfig(graphs=False, compile=False)
    assert not GraphCausalLM(random_llama(args, "cpu", torch.bfloat16), base).fused_layer
    with pytest.raises(ValueError, match="the Triton attention"):
        GraphCausalLM(random_llama(args, "cpu", torch.bfloat16), replace(base, attention="sdpa", fused_layer=True))
    with pytest.raises(ValueError, match="weights='fp8' needs the fused layer"):
        GraphCausalLM(random_llama(args, "cpu", torch.bfloat16), replace(base, weights="fp8"))
    with pytest.raises(ValueError, match="weights must be"):
        GraphCausalLM(random_llama(args, "cpu", torch.bfloat16), replace(base, weights="int4"))


def test_graph_config_refuses_bad_kernel_choices():
    """The fused layer's launch options are typed fields, checked when the config is made."""
    from pipeline.models.graphs import GraphConfig

    assert GraphConfig().gemv and GraphConfig().pdl_preload == "auto" and GraphConfig().tp_spin_timeout_s == 120.0
    with pytest.raises(ValueError, match="pdl_preload must be one of"):
        GraphConfig(pdl_preload="early")
    with pytest.raises(ValueError, match="tp_spin_timeout_s must be >= 0"):
        GraphConfig(tp_spin_timeout_s=-1.0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fused_layer_needs_half_precision_and_the_fused_rope():
    from dataclasses import replace

    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import random_llama

    args, base = _tiny_fused_args(), GraphConfig(graphs=False, compile=False)
    with pytest.raises(ValueError, match="half-precision weights"):
        GraphCausalLM(random_llama(args, "cpu", torch.float32), replace(base, attention="triton", fused_layer=True))
    with pytest.raises(ValueError, match="fused RoPE"):
        GraphCausalLM(random_llama(args, "cpu", torch.bfloat16),
                      replace(base, attention="triton", fused_rope=False, fused_layer=True))


def test_rope_reference_matches_the_eager_attention():
    """torch_rope_write writes what the eager runner's attention layer writes, and returns its rotated queries."""
    from dataclasses import replace

    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import SHAPES, random_llama

    args = replace(SHAPES["llama-1b"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128)
    eager = random_llama(args, "cpu", torch.float32, seed=1)
    graph = GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=1),
                          GraphConfig(graphs=False, compile=False, attention="sdpa", linear="torch", fused_rope=False))
    eager.allocate(3, 32)
    graph.allocate(2, 32)  # + its scratch slot: the same 3 slots
    tokens = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(2))
    positions, slots = torch.tensor([4, 9]), torch.tensor([1, 0])
    eager.forward(tokens, positions, slots)
    graph.forward(tokens, positions, slots)
    for slot, p in ((1, 4), (0, 9)):
        for a, b in ((eager.k_caches[0], graph.runner.k_caches[0]), (eager.v_caches[0], graph.runner.v_caches[0])):
            torch.testing.assert_close(a[slot, :, p : p + 3], b[slot, :, p : p + 3])
    # and the reference itself against that cache write
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(3))
    k, v = torch.zeros(3, 2, 32, 16), torch.zeros(3, 2, 32, 16)
    pos = positions[:, None] + torch.arange(3)
    q = torch_rope_write(qkv, graph.runner._cos, graph.runner._sin, pos, slots, k, v, 4)
    assert q.shape == (2, 2, 2 * 3, 16)
    torch.testing.assert_close(v[1, :, 4:7], qkv[0, :, 6 * 16 :].reshape(3, 2, 16).transpose(0, 1))
    assert k[2].abs().sum() == 0 and v[2].abs().sum() == 0  # the unused slot is untouched


@pytest.fixture(scope="module")
def interpreted_results():
    return run_interpreted(cases.__file__, parts=2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its CPU interpreter)")
@pytest.mark.parametrize("case", [c[0] for c in cases.LINEAR_CASES + cases.ROPE_CASES + cases.FUSED_CASES]
                         + cases.GRAPH_CASES + cases.PRELOAD_CASES + cases.GEMV_CASES + cases.FUSED_GRAPH_CASES
                         + [c[0] for c in cases.TP_FUSED_CASES])
def test_kernel_matches_reference_in_the_interpreter(interpreted_results, case):
    r = interpreted_results[case]
    assert "error" not in r, r["error"]
    assert r["ok"] and r["err"] <= r["tol"], r
