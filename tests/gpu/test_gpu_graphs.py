"""GPU checks of the captured path (skipped without CUDA): captured-graph logits against the eager runner
(relative error within bf16 tolerance), replays that really read new inputs, no host sync inside a step,
and greedy equivalence of batched speculative decoding on graphs with unbatched eager decoding; each of the
graph path's attention kernels ('triton': the split-KV kernel over the cache in place; 'sdpa': slot gather +
SDPA) against the eager runner, with and without a sliding window."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace

import pytest
import torch

from pipeline.adaptive import AdaptiveK
from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ModelDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.llama import LlamaCausalLM
from pipeline.models.shapes import SHAPES, random_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# 1B-shaped layers (GQA 32/8, head_dim 64), fewer of them and a smaller vocabulary: quick to build and capture.
SMALL = replace(SHAPES["llama-1b"], n_layers=4, vocab_size=4096)
HAS_TRITON = importlib.util.find_spec("triton") is not None
ATTENTIONS = [pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")), "sdpa"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_against_eager(graph, eager, ref32, lengths: list[int], shapes, seed: int, label: str):
    """Prefill `lengths[slot]` random tokens into every slot of the three runners, then run ragged calls of
    each (B, T) twice (capture, then replay) and require the graph path to be as close to float32 as the bf16
    eager path is (and close to it), with about as many float32 argmaxes. Returns the last call's inputs."""
    g = torch.Generator().manual_seed(seed)
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, SMALL.vocab_size, (1, n), generator=g).cuda()
        for m in (graph, eager, ref32):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    agree_graph = agree_eager = total = 0
    for B, T in shapes:
        for _ in range(2):  # first call captures, second replays
            slots = torch.randperm(len(lengths), generator=g)[:B]
            positions = torch.tensor([lengths[s] for s in slots])
            tokens = torch.randint(0, SMALL.vocab_size, (B, T), generator=g).cuda()
            got = graph.forward(tokens, positions, slots)
            want = eager.forward(tokens, positions, slots)
            exact = ref32.forward(tokens, positions, slots)
            assert torch.isfinite(got).all()
            assert _rel(got, want) < 3e-2, (label, B, T, _rel(got, want))
            assert _rel(got, exact) < 1.5 * _rel(want, exact) + 2e-3, (label, B, T, _rel(got, exact), _rel(want, exact))
            top = exact.argmax(-1)
            agree_graph += int((got.argmax(-1) == top).sum())
            agree_eager += int((want.argmax(-1) == top).sum())
            total += top.numel()
    # Random weights give near-flat logits, where bf16 rounding flips some argmaxes on either path: the
    # captured path must pick the float32 argmax about as often as the eager bf16 path does.
    assert agree_graph >= agree_eager - 0.05 * total, (label, agree_graph, agree_eager, total)
    return tokens, positions, slots


def _replay_without_host_sync(graph, tokens, positions, slots) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.forward(tokens, positions, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


RUNNER_CONFIGS = {  # the graph path's layer variants on bf16 weights
    "unfused-eager-kernels": GraphConfig(compile=False, fused_layer=False),
    "unfused-compiled": GraphConfig(compile=True, fused_layer=False),
    "fused": GraphConfig(),  # the default on CUDA: the fused layer, with PDL where the GPU has it
    "fused-nopdl": GraphConfig(pdl=False),
}


@pytest.fixture(scope="module", params=list(RUNNER_CONFIGS))
def runners(request):
    """(graph runner, eager runner with the same bf16 weights, float32 eager runner of those weights)."""
    dev = torch.device("cuda")
    graph = GraphCausalLM(random_llama(SMALL, dev, torch.bfloat16, seed=1), RUNNER_CONFIGS[request.param])
    assert graph.fused_layer == request.param.startswith("fused") or not HAS_TRITON
    eager = random_llama(SMALL, dev, torch.bfloat16, seed=1)
    ref32 = LlamaCausalLM(copy.deepcopy(eager.model).float(), eager.info)
    for m in (graph, eager, ref32):
        m.allocate(8, 1024)
    return graph, eager, ref32


def test_captured_logits_match_eager(runners):
    """The captured path is as close to float32 as the bf16 eager path is (and close to it)."""
    graph, eager, ref32 = runners
    _check_against_eager(graph, eager, ref32, [300, 17, 611, 64, 5, 900],
                         [(1, 1), (1, 5), (3, 1), (3, 5), (6, 4), (6, 8)], seed=0, label="captured")
    assert graph.stats.captures >= 6 and graph.stats.host_syncs == 0
    if graph.fused_layer:  # calls of up to 16 rows take it (1x1, 1x5, 3x1 here); larger ones the unfused layer
        assert graph.stats.fused_runs >= 6


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_pdl_changes_no_bit_of_the_fused_layer():
    """Programmatic dependent launch only lets kernels start early; every kernel waits for its predecessor
    before touching activations. Captured and replayed, the fused layer with PDL (the next kernel launches after
    a kernel's K loop), without it, and with PDL and every linear's first weight tile loaded before its wait
    (`pdl_preload="on"`) gives bit-identical logits: a missing wait would show up as a race here."""
    from pipeline.models import pdl

    dev = torch.device("cuda")
    out = {}
    every = GraphConfig(fused_layer=True)  # every call of up to 16 rows, not only batch 1
    for name, cfg in (("pdl", every), ("nopdl", replace(every, pdl=False)),
                      ("pdl-preload", replace(every, pdl_preload="on"))):
        graph = GraphCausalLM(random_llama(SMALL, dev, torch.bfloat16, seed=5), cfg)
        graph.allocate(8, 1024)
        g = torch.Generator().manual_seed(3)
        for slot in range(6):
            prompt = torch.randint(0, SMALL.vocab_size, (1, 30 + 50 * slot), generator=g).cuda()
            graph.forward(prompt, torch.tensor([0]), torch.tensor([slot]), prompt.shape[1] - 1)
        got = []
        for B, T in ((1, 1), (4, 3), (6, 1)):
            slots = torch.arange(B)
            positions = torch.tensor([30 + 50 * s for s in range(B)])
            tokens = torch.randint(0, SMALL.vocab_size, (B, T), generator=g).cuda()
            for _ in range(3):  # capture, then replays
                got.append(graph.forward(tokens, positions, slots))
        out[name] = got
        assert graph.fused_layer and graph.use_pdl == (name != "nopdl" and pdl.enabled(dev))
        assert graph.stats.fused_runs == 9  # three shapes, each run twice in the warm-up and once captured
    for name in ("nopdl", "pdl-preload"):
        assert all(torch.equal(a, b) for a, b in zip(out["pdl"], out[name])), name


def _fp8_exact_(model) -> None:
    """Give every matrix weights float8 holds exactly: e4m3 codes times a power of two, each row reaching 448."""
    import math

    for p in model.model.parameters():
        if p.dim() == 2:
            codes = (p.float() / p.float().abs().amax(1, keepdim=True) * 448).to(torch.float8_e4m3fn).float()
            codes[:, 0] = 448.0
            p.data.copy_((codes * 2.0 ** -(int(math.log2(448 * p.shape[1] ** 0.5)) + 1)).to(p.dtype))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fp8_weights_give_the_bf16_fused_layer_where_float8_is_exact():
    """weights='fp8' streams float8 copies with row scales. On weights float8 holds exactly it must give the bf16
    fused layer's logits up to summation order (each shape's kernels are tuned per weight dtype), captured and
    replayed; on ordinary random weights it stays near the bf16 eager runner (the quantization error)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    dev = torch.device("cuda")
    runners = {}
    for name, weights in (("fp8", "fp8"), ("bf16", "model")):
        m = random_llama(SMALL, dev, torch.bfloat16, seed=6)
        _fp8_exact_(m)
        runners[name] = GraphCausalLM(m, GraphConfig(fused_layer=True, weights=weights))
    noisy = GraphCausalLM(random_llama(SMALL, dev, torch.bfloat16, seed=6),
                          GraphConfig(fused_layer=True, weights="fp8"))
    eager = random_llama(SMALL, dev, torch.bfloat16, seed=6)
    g = torch.Generator().manual_seed(4)
    for m in (*runners.values(), noisy, eager):
        m.allocate(4, 512)
    for slot in range(3):
        prompt = torch.randint(0, SMALL.vocab_size, (1, 20 + 30 * slot), generator=g).cuda()
        for m in (*runners.values(), noisy, eager):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), prompt.shape[1] - 1)
    for B, T in ((1, 1), (1, 5), (3, 1)):
        slots, positions = torch.arange(B), torch.tensor([20 + 30 * s for s in range(B)])
        tokens = torch.randint(0, SMALL.vocab_size, (B, T), generator=g).cuda()
        for _ in range(2):  # capture, then replay
            a, b = (runners[k].forward(tokens, positions, slots) for k in ("fp8", "bf16"))
            assert _rel(a, b) < 5e-3, (B, T, _rel(a, b))
            got, want = noisy.forward(tokens, positions, slots), eager.forward(tokens, positions, slots)
            # float8 weights alone move this random model's logits by 0.12 (float32, CPU); a wrong or missing scale
            # moves them by 1 or more
            assert torch.isfinite(got).all() and _rel(got, want) < 0.25, (B, T, _rel(got, want))
    assert runners["fp8"].stats.fused_runs >= 9 and noisy.stats.fused_runs >= 9


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fp8_widened_by_its_bits_gives_torchs_e4m3_values():
    """One-row float8 products widen e4m3 by integer operations on its bits (`fused_linear_triton._widen`): on the
    GPU, with every finite code (subnormals too, so a flush to zero would show) in sums that are exact, the output
    bits of torch's own e4m3 conversion; the CPU interpreter runs the same case in CI
    (tests/support/graph_kernel_cases.py)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    import pipeline.models.fused_linear as fl
    from tests.support import graph_kernel_cases as cases

    r = cases.fp8_widen_case(torch, fl, "cuda")
    assert r["exact"] and r["ok"] and r["err"] <= r["tol"], r


def test_no_host_sync_inside_a_step(runners):
    graph = runners[0]
    tokens = torch.randint(0, SMALL.vocab_size, (2, 5), device="cuda")
    positions, slots = torch.tensor([40, 90]), torch.tensor([1, 4])
    graph.forward(tokens, positions, slots)  # capture outside the check
    _replay_without_host_sync(graph, tokens, positions, slots)


@pytest.fixture(scope="module", params=[None, 96], ids=["full", "window96"])
def attention_runners(request):
    """({attention: graph runner}, eager bf16 runner, float32 eager runner), all with the same weights."""
    dev = torch.device("cuda")
    shape = replace(SMALL, sliding_window=request.param)
    kinds = ["sdpa"] + (["triton"] if HAS_TRITON else [])
    graphs = {k: GraphCausalLM(random_llama(shape, dev, torch.bfloat16, seed=2),
                               GraphConfig(compile=False, attention=k))
              for k in kinds}
    eager = random_llama(shape, dev, torch.bfloat16, seed=2)
    ref32 = LlamaCausalLM(copy.deepcopy(eager.model).float(), eager.info)
    for m in (*graphs.values(), eager, ref32):
        m.allocate(8, 2048)
    return graphs, eager, ref32


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_graph_attention_matches_eager(attention_runners, attention):
    """Ragged rows (several key chunks, rows shorter than the bucket's S), verify-sized T up to the largest
    token bucket (G*T = 64 query rows), padding rows and columns: the graph path with this attention is as
    close to float32 as the bf16 eager path is, and replays read new inputs without a host sync."""
    graphs, eager, ref32 = attention_runners
    graph = graphs[attention]
    assert graph.attention == attention
    tokens, positions, slots = _check_against_eager(
        graph, eager, ref32, [1000, 17, 611, 64, 5, 1500, 255, 257],  # slot -> prefilled tokens
        [(1, 1), (1, 5), (3, 1), (3, 5), (6, 4), (8, 1), (2, 16)], seed=1, label=attention)
    assert graph.stats.captures >= 7 and graph.stats.host_syncs == 0
    _replay_without_host_sync(graph, tokens, positions, slots)


def test_auto_attention_is_triton_on_cuda():
    graph = GraphCausalLM(random_llama(replace(SMALL, n_layers=1), "cuda", torch.bfloat16), GraphConfig(compile=False))
    assert graph.attention == ("triton" if HAS_TRITON else "sdpa")


# The graph path's families: each one's layers at tiny sizes (Qwen3: q/k norms in the RoPE/cache-write kernel)
GREEDY_FAMILIES = {"llama": SMALL, "qwen3": SHAPES["qwen3-8b"]}


@pytest.mark.parametrize("family", list(GREEDY_FAMILIES))
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_greedy_speculative_on_graphs_equals_unbatched_eager_fp32(attention, family):
    greedy_speculative_on_graphs_equals_eager(GREEDY_FAMILIES[family], attention, torch.device("cuda"))


def greedy_speculative_on_graphs_equals_eager(base, attention: str, dev: torch.device) -> None:
    """Batched speculative decoding on graph runners (target and drafter of `base`'s family, float32, tiny
    sizes) gives the unbatched eager target's greedy tokens, token for token."""
    tiny = replace(base, n_layers=2, dim=256, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                   vocab_size=512, sliding_layers=None if base.sliding_layers is None else base.sliding_layers[:2])
    draft_shape = replace(tiny, n_layers=1)
    prompts = [[5, 17, 33, 17, 33, 9], list(range(40, 70)), [100, 7], [9] * 14, [4, 4, 8, 15, 16, 23, 42]]
    max_tokens = [40, 9, 33, 5, 21]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=0) for m in max_tokens]

    ref_engine = SpeculativeEngine(random_llama(tiny, dev, torch.float32, seed=3), None, None,
                                   EngineConfig(max_batch_size=1, max_seq_len=128, graphs=False))
    ref = [ref_engine.generate(p, q, SpecParams(0)).token_ids for p, q in zip(prompts, params)]

    cfg = GraphConfig(attention=attention)
    target = GraphCausalLM(random_llama(tiny, dev, torch.float32, seed=3), cfg)
    drafter = ModelDrafter(GraphCausalLM(random_llama(draft_shape, dev, torch.float32, seed=4), cfg))
    engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=3, max_seq_len=128),
                               k_policy=AdaptiveK(max_k=5, min_samples=1, explore_every=3))
    assert isinstance(engine.target, GraphCausalLM) and isinstance(drafter.model, GraphCausalLM)
    assert engine.target.attention == drafter.model.attention == attention
    got = [r.token_ids for r in engine.generate_batch(prompts, params, SpecParams(5))]
    assert got == ref
    assert engine.target.stats.captures > 0 or dev.type != "cuda"
    assert engine.target.stats.graph_calls > engine.target.stats.eager_calls
    # Neither model's steps read their positions back from the device: the engine and the drafter pass them
    # (and the slots) on the host.
    assert engine.target.stats.host_syncs == 0 and drafter.model.stats.host_syncs == 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_greedy_with_an_fp8_drafter_equals_the_float32_target():
    """A drafter whose graph path streams float8 weights (EngineConfig.draft_weights = 'fp8') changes
    what is proposed and accepted, never the output: greedy speculative decoding equals the float32 target's own
    greedy decoding token for token."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9+")
    dev = torch.device("cuda")
    tiny = replace(SMALL, n_layers=2, dim=256, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                   vocab_size=512)
    prompts = [[5, 17, 33, 17, 33, 9], list(range(40, 70)), [100, 7], [4, 4, 8, 15, 16, 23, 42]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=0) for m in (40, 9, 33, 21)]
    ref_engine = SpeculativeEngine(random_llama(tiny, dev, torch.float32, seed=3), None, None,
                                   EngineConfig(max_batch_size=1, max_seq_len=128, graphs=False))
    ref = [ref_engine.generate(p, q, SpecParams(0)).token_ids for p, q in zip(prompts, params)]
    # the drafter: the target's own weights in bf16 (so it proposes well), streamed as float8
    drafter = ModelDrafter(random_llama(tiny, dev, torch.bfloat16, seed=3))
    engine = SpeculativeEngine(random_llama(tiny, dev, torch.float32, seed=3), None, drafter,
                               EngineConfig(max_batch_size=2, max_seq_len=128, draft_weights="fp8"))
    assert isinstance(drafter.model, GraphCausalLM) and drafter.model._fp8
    got = [r.token_ids for r in engine.generate_batch(prompts, params, SpecParams(4))]
    assert got == ref
    assert drafter.model.stats.fused_runs > 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_device_loop_equals_the_step_path_fp32():
    """The device loop (one captured CUDA graph a step, read one step behind) gives the step-by-step path's tokens,
    greedy and seeded sampled, with rows that end at different steps, and reads no position back from the device."""
    dev = torch.device("cuda")
    tiny = replace(SMALL, n_layers=2, dim=256, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
                   vocab_size=512)
    prompts = [[5, 17, 33, 17, 33, 9], list(range(40, 70)), [100, 7]]
    runs = {}
    for loop in (False, True):
        target = random_llama(tiny, dev, torch.float32, seed=3)
        drafter = ModelDrafter(random_llama(replace(tiny, n_layers=1), dev, torch.float32, seed=3))
        engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=3, max_seq_len=128,
                                                                       device_loop=loop))
        greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 9, 33)]
        sampled = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True)
                   for s in (1, 2, 3)]
        runs[loop] = [[r.token_ids for r in engine.generate_batch(prompts, p, SpecParams(4))]
                      for p in (greedy, sampled, sampled)]
        if loop:
            assert any(lp._graph is not None for lp in engine._loops.values())
            assert engine.target.stats.host_syncs == 0 and drafter.model.stats.host_syncs == 0
    assert runs[True] == runs[False]
    assert runs[True][1] == runs[True][2]  # seeded requests replay


def test_float32_graph_logits_do_not_depend_on_the_step_shape():
    """A float32 model's logits for a token must not depend on whether it was fed alone (decode, T = 1) or in a
    verify block (T = 5): otherwise greedy output with speculation differs from without it (seen on an H100 when
    decode rows took a TF32 kernel and verify rows cuBLAS float32). Captured path, a T=1 call vs the first
    column of a T=5 call at the same state, relative difference at float32 rounding level."""
    dev = torch.device("cuda")
    graph = GraphCausalLM(random_llama(SMALL, dev, torch.float32, seed=4), GraphConfig())
    graph.allocate(4, 512)
    g = torch.Generator().manual_seed(1)
    for slot in range(3):
        prompt = torch.randint(0, SMALL.vocab_size, (1, 40 + slot), generator=g).cuda()
        graph.forward(prompt, torch.tensor([0]), torch.tensor([slot]), prompt.shape[1] - 1)
    slots, positions = torch.tensor([2, 0, 1]), torch.tensor([42, 40, 41])
    block = torch.randint(0, SMALL.vocab_size, (3, 5), generator=g).cuda()
    for _ in range(2):  # capture, then replay
        one = graph.forward(block[:, :1], positions, slots)[:, 0]
        five = graph.forward(block, positions, slots)[:, 0]
        assert _rel(one, five) < 1e-5, _rel(one, five)
        assert torch.equal(one.argmax(-1), five.argmax(-1))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_warmup_captures_the_step_shapes_once_and_a_growing_context_needs_no_more():
    """`warmup` captures the (batch, tokens) grid up front. With the Triton attention a graph serves every
    context length (its key chunks follow the rows' positions), so decoding across several 256-key blocks, with
    verify calls in between, captures nothing more and still gives the eager runner's logits."""
    dev = torch.device("cuda")
    graph = GraphCausalLM(random_llama(SMALL, dev, torch.bfloat16, seed=6), GraphConfig())
    eager = random_llama(SMALL, dev, torch.bfloat16, seed=6)
    for m in (graph, eager):
        m.allocate(4, 1024)
    assert graph.warmup(3, 3) == 9  # batch buckets 1, 2, 4 x token buckets 1, 2, 3
    assert graph.warmup(3, 3) == 0 and graph.stats.captures == 9
    g = torch.Generator().manual_seed(2)
    lengths = [200, 37]
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, SMALL.vocab_size, (1, n), generator=g).cuda()
        for m in (graph, eager):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    slots, worst = torch.tensor([0, 1]), 0.0
    for step in range(560):  # slot 0 goes from 200 to 760 keys
        T = 3 if step % 40 == 0 else 1  # a verify call now and then; only its first token is kept
        tokens = torch.randint(0, SMALL.vocab_size, (2, T), generator=g).cuda()
        positions = torch.tensor(lengths)
        got = graph.forward(tokens, positions, slots)
        if step % 20 == 0 or T > 1:
            want = eager.forward(tokens, positions, slots)
            worst = max(worst, _rel(got, want))
        else:  # keep the eager cache in step without comparing
            eager.forward(tokens, positions, slots, T - 1)
        lengths = [n + 1 for n in lengths]
    assert graph.stats.captures == 9, graph.stats.shapes
    assert worst < 3e-2, worst


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_engine_warmup_leaves_no_capture_to_the_steps():
    """After `SpeculativeEngine.warmup(K)`, speculative decoding with a draft model and adaptive K (up to K) over
    growing contexts captures no graph, in the target or the drafter, and is still exact (greedy = target
    alone; float32, where the engine promises that across step shapes)."""
    dev, f32 = torch.device("cuda"), torch.float32

    def build(with_drafter: bool) -> SpeculativeEngine:
        drafter = ModelDrafter(random_llama(replace(SMALL, n_layers=1), dev, f32, seed=8)) if with_drafter else None
        return SpeculativeEngine(random_llama(SMALL, dev, f32, seed=7), None, drafter,
                                 EngineConfig(max_batch_size=3, max_seq_len=640, device="cuda", dtype="float32"),
                                 k_policy=AdaptiveK(max_k=4) if with_drafter else None)

    engine = build(True)
    warm = engine.warmup(4)
    # batch buckets 1, 2, 4 x the target's T = 1..5 and the drafter's every token bucket (1-6, 8, 12, 16, 24, 32)
    assert warm["captures"] == 3 * 5 + 3 * len(GraphConfig().token_buckets), warm
    before = engine._captures()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist() for n in (250, 40, 300)]
    params, spec = SamplingParams(max_tokens=300, ignore_eos=True), SpecParams(num_draft_tokens=4)
    got = engine.generate_batch(prompts, params, spec)
    assert engine._captures() == before, engine.target.stats.shapes
    assert sum(k * n for k, n in engine.timings.steps_by_k.items()) > 0  # it did speculate
    alone = build(False).generate_batch(prompts, params, SpecParams(num_draft_tokens=0))
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tp_fused_allreduce_on_the_gpu():
    """The fused all-reduce's push and reduce (`pipeline.models.tp_fused`) with GPU memory and loads: two and three
    ranks simulated on one GPU against the eager bf16 math (the case CI runs in the interpreter)."""
    import pipeline.models.fused_linear as fl
    from tests.support import graph_kernel_cases as cases

    for R, M in ((2, 1), (3, 5)):
        r = cases.tp_fused_case(torch, fl, R, M, "cuda")
        assert r["ok"] and r["err"] <= r["tol"], (R, M, r)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_tp_reduce_traps_instead_of_hanging_when_a_rank_never_writes():
    """A reduce whose peer never pushes gives up after its spin timeout (1 s here; `GraphConfig.tp_spin_timeout_s`
    in a model): the process fails (its CUDA context trapped) instead of spinning for ever. Control: the same
    process with every rank pushing finishes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = {}
    for all_push in (True, False):
        code = ("import sys; from tests.support import graph_kernel_cases as c; "
                f"sys.exit(c.tp_missing_rank_main({all_push}, spin_timeout_s=1.0))")
        runs[all_push] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        timeout=300)
    ok, missing = runs[True], runs[False]
    assert ok.returncode == 0 and "reduced" in ok.stdout, ok.stderr[-2000:]
    assert missing.returncode != 0 and "reduced" not in missing.stdout, (missing.stdout, missing.stderr[-2000:])
