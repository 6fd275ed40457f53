"""GPU benchmark of the decode path, one command on the GPU machine, a table at the end.

    python -m ops.gpu_bench --part steps --out $OUT          # step latencies, floors, HF baselines
    python -m ops.gpu_bench --part steps --attention triton,sdpa --out $OUT   # ours with each attention
    python -m ops.gpu_bench --part demo --gguf F.gguf --out $OUT   # the demo pair end to end
    python -m ops.gpu_bench --part steps --shapes llama-8b,qwen3-8b,gemma2-2b,gemma2-9b,gemma3-4b,gemma3-12b \
        --batches 1 --hf-batches "" --profile-batches "" --deadline-s 60 --out $OUT   # other families' shapes

steps: the bandwidth floor measured on this card (a large device-to-device copy: bytes read + written over
time); then per model shape (random bf16 weights) and batch B, the latency of one step feeding T = 1 and
T = K+1 tokens per row at context `--context`: this engine's graph runner (`pipeline.models.graphs`), the same
model eager, Hugging Face eager (DynamicCache) and Hugging Face compiled (StaticCache +
torch.compile(mode="reduce-overhead")). floor = (weights read once + KV read + KV written) / copy bandwidth.
`--shapes` names the shapes (`pipeline.models.shapes.SHAPES`: Llama, Qwen3, Gemma 2 and Gemma 3 shapes, all on
the graph runner); a shape whose family the graph runner lacked (`graph_path_reason`) would be timed on the eager
fast path, its rows marked `eager`. A sliding-window layer's floor reads at most its window of keys.
`--attention` lists the graph runner's attention variants to time (`GraphConfig.attention`: triton = the
split-KV kernel reading the cache in place, sdpa = slot gather + SDPA, auto = the defaults) or runner
variants (`VARIANTS`: prev = triton attention with cuBLAS linears and the unfused RoPE/cache write, rope = +
the fused RoPE/cache write, kernels = + the tuned skinny linears, fused = the fused layer of
`pipeline.models.fused_linear` with programmatic dependent launch on every call of up to 16 rows (auto takes
it for batch-1 calls), fused-nopdl = without PDL, fused-[no]preload = every linear's first weight tile loaded
before the PDL wait, or none (`GraphConfig.pdl_preload`; default: float8 weights only), fused-nogemv = one-row
calls on the tensor cores only (`GraphConfig.gemv=False`), fused-fp8 = the fused layer streaming float8 weight
copies, a drafter's option, checked against the first variant's bf16 8B step): one table row, one profile and
one set of checks per variant (checks of a variant past the first are suffixed).
demo: the demo target and the default drafter (prompt lookup) end to end, greedy: this engine vs HF generate
vs HF assisted generation with the same drafter (`specserve.spec_bench.run_bench`); then 32 concurrent requests
with speculation off, on at fixed K and on with the adaptive K policy: aggregate tokens/s.

Every number is a median over timed repeats with CUDA events, after warm-up (capture, compilation).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.models.graphs import GraphCausalLM, GraphConfig, graph_path_reason  # noqa: E402
from pipeline.models.kernel_timing import copy_GBps  # noqa: E402
from pipeline.models.shapes import SHAPES, kv_bytes_per_token, random_llama, weight_bytes_read  # noqa: E402

T0 = time.perf_counter()
DEFAULT_SHAPES = "llama-8b,llama-1b,llama-1b-v32k"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def time_fn(fn: Callable[[], Any], iters: int = 30, warmup: int = 3, reset: Callable[[], Any] | None = None) -> dict:
    """Median/p10/p90 milliseconds of fn() on the current stream, timed with CUDA events, calls back to back."""
    for _ in range(warmup):
        if reset:
            reset()
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in ev:
        if reset:
            reset()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in ev)
    return {"median_ms": statistics.median(ms), "p10_ms": ms[len(ms) // 10], "p90_ms": ms[(9 * len(ms)) // 10]}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# steps


def copy_bandwidth(gib: float = 4.0) -> dict:
    gbps = copy_GBps(gib=gib)
    n = int(gib * 2**30)
    return {"bytes_moved": 2 * n, "median_ms": 2 * n / (gbps * 1e9) * 1e3, "GBps": gbps}


def floor_ms(shape: str, B: int, T: int, context: int, bw_GBps: float, weight_scale: float = 1.0) -> float:
    """(weights read once + KV read + KV written) / bandwidth; weight_scale 0.5: float8 weights (fused-fp8)."""
    a = SHAPES[shape]
    kv = kv_bytes_per_token(a)
    # keys read per row: every position on a global layer, at most the window on a sliding one (Gemma, Mistral)
    read = sum(min(context + T, a.window(i) or context + T) for i in range(a.n_layers)) / a.n_layers
    bytes_ = weight_scale * weight_bytes_read(a) + B * read * kv + B * T * kv
    return bytes_ / (bw_GBps * 1e9) * 1e3


# Graph-runner variants `--attention` may name besides a plain attention kind (auto, triton, sdpa):
VARIANTS = {
    "prev": {"attention": "triton", "linear": "torch", "fused_rope": False, "fused_layer": False},  # the baseline
    "rope": {"attention": "triton", "linear": "torch", "fused_rope": True, "fused_layer": False},  # + RoPE/cache
    "kernels": {"attention": "triton", "linear": "auto", "fused_rope": True, "fused_layer": False},  # + linears
    # the fused layer (pipeline.models.fused_linear) with programmatic dependent launch, and its alternatives
    "fused": {"attention": "triton", "fused_rope": True, "fused_layer": True},
    "fused-nopdl": {"attention": "triton", "fused_rope": True, "fused_layer": True, "pdl": False},
    "fused-nopreload": {"attention": "triton", "fused_rope": True, "fused_layer": True, "pdl_preload": "off"},
    "fused-preload": {"attention": "triton", "fused_rope": True, "fused_layer": True, "pdl_preload": "on"},
    "fused-nogemv": {"attention": "triton", "fused_rope": True, "fused_layer": True, "gemv": False},
    # float8 weights with row scales: for drafters (their precision moves acceptance, never the output)
    "fused-fp8": {"attention": "triton", "fused_rope": True, "fused_layer": True, "weights": "fp8"},
    "fused-fp8-nopreload": {"attention": "triton", "fused_rope": True, "fused_layer": True, "weights": "fp8",
                            "pdl_preload": "off"},
    "fused-fp8-preload": {"attention": "triton", "fused_rope": True, "fused_layer": True, "weights": "fp8",
                          "pdl_preload": "on"},
    "fused-fp8-nogemv": {"attention": "triton", "fused_rope": True, "fused_layer": True, "weights": "fp8",
                         "gemv": False},
}


def variant_config(name: str) -> GraphConfig:
    """The variant's GraphConfig (a plain attention kind: that attention, everything else default)."""
    return GraphConfig(**VARIANTS.get(name, {"attention": name}))


def _is_fp8(variant: str | None) -> bool:
    """Whether a variant streams float8 weights (its floor counts one byte per weight)."""
    return VARIANTS.get(variant or "", {}).get("weights") == "fp8"


def variant_label(name: str, graph: GraphCausalLM) -> str:
    """The variant's name, or the attention it resolved to ('auto' -> triton | sdpa; sdpa after a fallback)."""
    return name if name in VARIANTS else graph.attention


def past(deadline_s: float | None) -> bool:
    """Whether the run is past its deadline (no new measurement starts then)."""
    return deadline_s is not None and elapsed() > deadline_s


def bench_ours(shape: str, batches: list[int], Ts: list[int], context: int, eager_batches: list[int],
               attention: str = "auto", device: str = "cuda", deadline_s: float | None = None) -> list[dict]:
    dev = torch.device(device)
    if graph_path_reason(SHAPES[shape]) is not None:
        return bench_eager(shape, batches, Ts, context, dev, deadline_s)
    runner = random_llama(shape, dev, torch.bfloat16, seed=0)
    graph = GraphCausalLM(runner, variant_config(attention))
    graph.allocate(max(batches), context + 256)
    for c in runner.k_caches + runner.v_caches:
        c.normal_()
    V = SHAPES[shape].vocab_size
    rows = []
    for B in batches:
        for T in Ts:
            if past(deadline_s):
                log(f"ours {shape} B={B} T={T}: skipped (deadline)")
                continue
            tokens = torch.randint(0, V, (B, T), device=dev)
            positions = torch.full((B,), context, dtype=torch.int64)  # host tensors, as the engine passes them
            slots = torch.arange(B)
            t_first = time.perf_counter()
            graph.forward(tokens, positions, slots)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t_first
            step = time_fn(lambda: graph.forward(tokens, positions, slots))
            key = graph.shape_for(B, T, context)  # None: past every captured shape, the call ran uncaptured
            captured = graph._graphs[key].graph if key is not None else None
            replay = time_fn(captured.replay) if captured is not None else {"median_ms": float("nan")}
            row = {"impl": "ours-graph", "model": shape, "B": B, "T": T, "ms": step["median_ms"],
                   "p90_ms": step["p90_ms"], "replay_ms": replay["median_ms"], "bucket": key, "first_call_s": first_s,
                   "attention": variant_label(attention, graph)}
            if B in eager_batches:
                row["eager_ms"] = time_fn(lambda: runner.forward(tokens, positions, slots), iters=10)["median_ms"]
            rows.append(row)
            log(f"ours[{variant_label(attention, graph)}] {shape} B={B} T={T}: {step['median_ms']:.3f} ms "
                f"(replay {replay['median_ms']:.3f}, "
                f"eager {row.get('eager_ms', float('nan')):.2f}, first call {first_s:.1f} s)")
    graph = runner = None  # free the GPU memory before the next shape
    free()
    return rows


def bench_eager(shape: str, batches: list[int], Ts: list[int], context: int, dev: torch.device,
                deadline_s: float | None = None) -> list[dict]:
    """The eager fast path's step latencies, for a shape whose family the graph runner lacks."""
    runner = random_llama(shape, dev, torch.bfloat16, seed=0)
    runner.allocate(max(batches), context + 256)
    for c in runner.k_caches + runner.v_caches:
        c.normal_()
    V, rows = SHAPES[shape].vocab_size, []
    why = graph_path_reason(SHAPES[shape])
    for B in batches:
        for T in Ts:
            if past(deadline_s):
                log(f"ours-eager {shape} B={B} T={T}: skipped (deadline)")
                continue
            tokens = torch.randint(0, V, (B, T), device=dev)
            positions, slots = torch.full((B,), context, dtype=torch.int64), torch.arange(B)
            t_first = time.perf_counter()
            runner.forward(tokens, positions, slots)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t_first
            step = time_fn(lambda: runner.forward(tokens, positions, slots), iters=20)
            rows.append({"impl": "ours-eager", "model": shape, "B": B, "T": T, "ms": step["median_ms"],
                         "p90_ms": step["p90_ms"], "first_call_s": first_s, "attention": "eager", "why": why})
            log(f"ours-eager {shape} B={B} T={T}: {step['median_ms']:.3f} ms (first call {first_s:.1f} s)")
    runner = None
    free()
    return rows


def hf_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    a = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                      head_dim=a.head_dim, tie_word_embeddings=a.tie_embeddings, rms_norm_eps=a.norm_eps,
                      max_position_embeddings=a.max_position_embeddings)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.05)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02)
    return model.eval().requires_grad_(False)


def _cache_kw(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def bench_hf_eager(model, shape: str, batches: list[int], Ts: list[int], context: int) -> list[dict]:
    V, kw, rows = SHAPES[shape].vocab_size, _cache_kw(model), []
    for B in batches:
        with torch.inference_mode():
            prompt = torch.randint(0, V, (B, context), device="cuda")
            cache = model(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
            for T in Ts:
                tokens = torch.randint(0, V, (B, T), device="cuda")
                t = time_fn(lambda: model(input_ids=tokens, use_cache=True, **{kw: cache}), iters=10,
                            reset=lambda: cache.crop(context))
                rows.append({"impl": "hf-eager", "model": shape, "B": B, "T": T, "ms": t["median_ms"]})
                log(f"hf-eager {shape} B={B} T={T}: {t['median_ms']:.2f} ms")
        cache = None
        free()
    return rows


def _static_cache(model, B: int, max_len: int):
    from transformers import StaticCache

    for kwargs in ({"config": model.config, "max_cache_len": max_len},
                   {"config": model.config, "max_batch_size": B, "max_cache_len": max_len, "device": "cuda",
                    "dtype": torch.bfloat16}):
        try:
            return StaticCache(**kwargs)
        except TypeError:
            continue
    raise RuntimeError("no StaticCache signature matched")


def bench_hf_compiled(model, shape: str, B: int, Ts: list[int], context: int, deadline_s: float) -> list[dict]:
    V, kw, rows = SHAPES[shape].vocab_size, _cache_kw(model), []
    compiled = torch.compile(model.forward, mode="reduce-overhead")
    for T in Ts:
        if elapsed() > deadline_s:
            log(f"hf-compiled {shape} B={B} T={T}: skipped (time budget)")
            continue
        cache = _static_cache(model, B, context + 16)
        with torch.inference_mode():
            prompt = torch.randint(0, V, (B, context), device="cuda")
            model(input_ids=prompt, use_cache=True, logits_to_keep=1,
                  cache_position=torch.arange(context, device="cuda"), **{kw: cache})
            tokens = torch.randint(0, V, (B, T), device="cuda")
            cache_position = torch.arange(context, context + T, device="cuda")
            position_ids = cache_position[None].expand(B, T)
            step = lambda: compiled(input_ids=tokens, position_ids=position_ids, cache_position=cache_position,  # noqa: E731
                                    use_cache=True, **{kw: cache})
            t_first = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t_first
            t = time_fn(step, iters=20)
        rows.append({"impl": "hf-compiled", "model": shape, "B": B, "T": T, "ms": t["median_ms"], "compile_s": first_s})
        log(f"hf-compiled {shape} B={B} T={T}: {t['median_ms']:.2f} ms (compile+warm-up {first_s:.0f} s)")
        cache = None
        free()
    torch._dynamo.reset()
    free()
    return rows


def bench_hf_generate_static(model, shape: str, B: int, context: int, n1: int = 16, n2: int = 80) -> list[dict]:
    """HF's own compiled decoding: generate() with a static cache, which compiles the decoding forward
    (reduce-overhead); the per-step latency is the slope between two generation lengths."""
    V = SHAPES[shape].vocab_size
    prompt = torch.randint(0, V, (B, context), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    gen = lambda n: model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)  # noqa: E731
    t_first = time.perf_counter()
    with torch.inference_mode():
        for n in (n1, n2, n1, n2):
            gen(n)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t_first
        seconds = {}
        for n in (n1, n2):
            runs = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen(n)
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - t0)
            seconds[n] = statistics.median(runs)
    ms = (seconds[n2] - seconds[n1]) / (n2 - n1) * 1e3
    log(f"hf-compiled (generate, static cache) {shape} B={B} T=1: {ms:.2f} ms/step (compile+warm-up {first_s:.0f} s)")
    return [{"impl": "hf-compiled", "how": "generate(cache_implementation='static')", "model": shape, "B": B, "T": 1,
             "ms": ms, "compile_s": first_s}]


def run_hf_compiled_part(args, result: dict, save: Callable[[], None]) -> None:
    """One HF compiled measurement in this process (a failed compiled kernel can poison the CUDA context)."""
    model = hf_model(args.hf_shape)
    rows = result.setdefault("rows", [])
    if args.hf_how == "generate":
        rows += bench_hf_generate_static(model, args.hf_shape, 1, args.context)
    else:
        rows += bench_hf_compiled(model, args.hf_shape, 1, [args.k + 1], args.context, deadline_s=1e9)
    save()


def hf_compiled_subprocess(args, shape: str, how: str, timeout_s: float) -> tuple[list[dict], str | None]:
    import subprocess

    out = Path("/tmp") / f"hfc_{shape}_{how}"
    cmd = [sys.executable, "-m", "ops.gpu_bench", "--part", "hf-compiled", "--hf-shape", shape, "--hf-how", how,
           "--context", str(args.context), "-k", str(args.k), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return [], f"hf-compiled {shape} {how}: timed out after {timeout_s:.0f} s"
    path = out / "gpu_bench_hf-compiled.json"
    rows = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    for line in proc.stdout.splitlines():
        if "hf-compiled" in line:
            log(line.split("] ", 1)[-1])
    err = None if proc.returncode == 0 and rows else f"hf-compiled {shape} {how}: rc {proc.returncode}: " + \
        "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return rows, err


def profile_breakdown(shape: str, cases: list[tuple[int, int]], context: int, attention: str = "auto",
                      dtype: torch.dtype = torch.bfloat16, top: int = 0) -> list[dict]:
    """Per-kernel-class GPU time of one captured step (torch.profiler over graph replays); `top` > 0 also logs
    that many kernels, the most expensive first."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    runner = random_llama(shape, dev, dtype, seed=0)
    graph = GraphCausalLM(runner, variant_config(attention))
    graph.allocate(max(b for b, _ in cases), context + 256)
    out = []
    for B, T in cases:
        tokens = torch.randint(0, SHAPES[shape].vocab_size, (B, T), device=dev)
        positions, slots = torch.full((B,), context, dtype=torch.int64), torch.arange(B)
        graph.forward(tokens, positions, slots)
        g = graph._graphs[graph.shape_for(B, T, context)].graph
        torch.cuda.synchronize()
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        classes: dict[str, list[float]] = {}
        kernels = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if t <= 0:
                continue
            n = e.key.lower()
            cls = ("gemm" if any(w in n for w in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "splitk", "skinny",
                                                  "fused_linear")) else
                   "rope/cache write" if "rope_cache_write" in n else
                   "attention" if any(w in n for w in ("fmha", "attention", "flash")) else
                   "triton (compiled)" if "triton" in n else
                   "index/gather" if "index" in n else "other")
            c = classes.setdefault(cls, [0.0, 0])
            c[0] += t / 1e3 / reps
            c[1] += e.count / reps
            kernels.append((t / 1e3 / reps, e.count / reps, e.key[:90]))
        for ms, count, name in sorted(kernels, reverse=True)[:top]:
            log(f"    {ms:7.3f} ms {count:5.0f}x  {name}")
        row = {"model": shape, "B": B, "T": T, "attention": variant_label(attention, graph),
               "classes": {k: {"ms": v[0], "kernels": v[1]} for k, v in classes.items()}}
        out.append(row)
        log(f"profile[{variant_label(attention, graph)}] {shape} B={B} T={T}: "
            + ", ".join(f"{k} {v[0]:.2f} ms/{v[1]:.0f} kernels"
                        for k, v in sorted(classes.items(), key=lambda kv: -kv[1][0])))
    del graph, runner
    free()
    return out


def run_steps(args, result: dict, save: Callable[[], None]) -> None:
    result["copy"] = bw = copy_bandwidth()
    log(f"copy bandwidth {bw['GBps']:.0f} GB/s")
    save()
    batches = [int(b) for b in args.batches.split(",")]
    Ts = [1, args.k + 1]
    rows = result.setdefault("rows", [])
    attentions = result["attention_variants"] = [a.strip() for a in args.attention.split(",") if a.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    plan = [(shape, [1] if shape == "llama-1b-v32k" else batches, Ts) for shape in shapes]
    for shape, bs, ts in plan:
        for i, attention in enumerate(attentions):
            if past(args.deadline_s):
                result.setdefault("errors", []).append(f"ours[{attention}] {shape}: skipped (deadline)")
                log(f"ours[{attention}] {shape}: skipped (deadline)")
                continue
            if i > 0 and graph_path_reason(SHAPES[shape]) is not None:
                continue  # the eager path has no attention variants
            try:  # the eager runner does not depend on the graph attention: timed with the first variant only
                rows += bench_ours(shape, bs, ts, args.context, eager_batches=[1] if i == 0 else [],
                                   attention=attention, device=args.device, deadline_s=args.deadline_s)
            except Exception:  # noqa: BLE001 - record and go on: the other numbers are still worth having
                result.setdefault("errors", []).append(f"ours[{attention}] {shape}: {traceback.format_exc()}")
                log(traceback.format_exc())
            save()
    from pipeline.models.skinny_linear import chosen
    result["linear_choices"] = chosen()  # what linear='auto' picked per shape, with its timings
    for name, c in result["linear_choices"].items():
        t = c["timings_ms"]
        log(f"linear {name}: {c['choice']} ({min(t.values()):.4f} ms; torch {t.get('torch', float('nan')):.4f} ms)")
    from pipeline.models.fused_linear import chosen as fused_chosen
    result["fused_choices"] = fused_chosen()  # the fused layer's configuration per shape
    for name, c in result["fused_choices"].items():
        log(f"fused_linear {name}: {c}")
    result["profile"] = []
    profile_batches = [int(b) for b in args.profile_batches.split(",") if b.strip()]
    for attention in attentions if profile_batches else ():
        try:
            result["profile"] += profile_breakdown("llama-8b", [(b, 1) for b in profile_batches], args.context,
                                                   attention)
            result["profile"] += profile_breakdown("llama-1b", [(1, 1)], args.context, attention)
        except Exception:  # noqa: BLE001
            result.setdefault("errors", []).append(f"profile[{attention}]: {traceback.format_exc()}")
            log(traceback.format_exc())
        save()
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b.strip()]
    for shape in [s for s in ("llama-8b", "llama-1b") if s in shapes] if hf_batches else ():
        try:
            model = hf_model(shape)
            rows += bench_hf_eager(model, shape, hf_batches, Ts, args.context)
            del model
            free()
        except Exception:  # noqa: BLE001
            result.setdefault("errors", []).append(f"hf {shape}: {traceback.format_exc()}")
            log(traceback.format_exc())
            free()
        save()
    for shape, how in (("llama-8b", "generate"), ("llama-8b", "direct"), ("llama-1b", "generate")):
        if not hf_batches or shape not in shapes:
            break
        left = args.budget_s - elapsed()
        if left < 40:
            result.setdefault("errors", []).append(f"hf-compiled {shape} {how}: skipped (time budget)")
            continue
        got, err = hf_compiled_subprocess(args, shape, how, left)
        rows += got
        if err:
            result.setdefault("errors", []).append(err)
            log(err)
        save()
    for r in rows:
        fp8 = r["impl"] == "ours-graph" and _is_fp8(r.get("attention"))
        r["floor_ms"] = floor_ms(r["model"], r["B"], r["T"], args.context, bw["GBps"], 0.5 if fp8 else 1.0)
    result["checks"] = []
    variants = _attentions(rows)
    for i, attention in enumerate(variants):
        result["checks"] += checks(rows, attention, suffix="" if i == 0 else f" [{attention}]")
    result["checks"] += family_checks(rows, [s for s in shapes if not s.startswith(("llama", "smollm"))],
                                      variants[0] if variants else None)
    # A float8 drafter against the bf16 target: the 1B-shaped steps of an fp8 variant over the first variant's 8B step
    target_8b = _ms(rows, "ours-graph", "llama-8b", 1, 1, variants[0]) if variants else None
    for attention in (v for v in variants if _is_fp8(v)):
        for m in ("llama-1b", "llama-1b-v32k"):
            d = _ms(rows, "ours-graph", m, 1, 1, attention)
            result["checks"].append({"check": f"{m} B=1 step [{attention}] / 8B B=1 step [{variants[0]}]",
                                     "value": d / target_8b if d and target_8b else None, "limit": 0.15,
                                     "met": None if not (d and target_8b) else d / target_8b <= 0.15})


def _attentions(rows: list[dict]) -> list[str]:
    """The resolved attention variants of our rows, in the order they were run."""
    return list(dict.fromkeys(r.get("attention") for r in rows if r["impl"] == "ours-graph"))


def _ms(rows: list[dict], impl: str, model: str, B: int, T: int, attention: str | None = None) -> float | None:
    for r in rows:
        if (r["impl"], r["model"], r["B"], r["T"]) == (impl, model, B, T) and (
                attention is None or r.get("attention") == attention):
            return r["ms"]
    return None


def _floor(rows: list[dict], model: str, B: int, T: int, attention: str | None = None) -> float | None:
    """The floor of that step: of our row of this variant (float8 variants read half the weight bytes), else the
    first row of the shape."""
    shape_rows = [r for r in rows if (r["model"], r["B"], r["T"]) == (model, B, T) and "floor_ms" in r]
    own = [r for r in shape_rows if r["impl"] == "ours-graph" and r.get("attention") == attention]
    return (own or shape_rows or [{}])[0].get("floor_ms")


def checks(rows: list[dict], attention: str | None = None, suffix: str = "") -> list[dict]:
    """The step-latency targets, each with its measured value (None: not measured)."""
    g = lambda m, B, T: _ms(rows, "ours-graph", m, B, T, attention)  # noqa: E731
    out = []

    def add(name: str, value: float | None, limit: float) -> None:
        out.append({"check": name + suffix, "value": value, "limit": limit,
                    "met": None if value is None else value <= limit})

    d1, d5 = g("llama-8b", 1, 1), g("llama-8b", 1, 5)
    fl = _floor(rows, "llama-8b", 1, 1, attention)
    add("8B B=1 decode / floor", d1 / fl if d1 and fl else None, 1.25)
    add("8B B=1 verify 5 / decode 1", d5 / d1 if d1 and d5 else None, 1.10)
    for m in ("llama-1b", "llama-1b-v32k"):
        d = g(m, 1, 1)
        add(f"{m} B=1 step / 8B B=1 step", d / d1 if d and d1 else None, 0.15)
    d16 = g("llama-8b", 16, 1)
    add("8B B=16 step / B=1 step", d16 / d1 if d16 and d1 else None, 1.5)
    return out


def family_checks(rows: list[dict], shapes: list[str], attention: str | None) -> list[dict]:
    """The Llama 8B shape's step targets for other families' shapes: B=1 decode within 1.15x its floor, verify of
    5 within 1.10x decode of 1 (graph rows of the first variant; eager rows where the family has no graph path)."""
    out = []
    for m in shapes:
        def g(B: int, T: int, m: str = m) -> float | None:
            return _ms(rows, "ours-graph", m, B, T, attention) or _ms(rows, "ours-eager", m, B, T)
        path = "graph" if graph_path_reason(SHAPES[m]) is None else "eager"
        d1, d5, fl = g(1, 1), g(1, 5), _floor(rows, m, 1, 1, attention if path == "graph" else "eager")
        for name, value, limit in ((f"{m} B=1 decode / floor [{path}]", d1 / fl if d1 and fl else None, 1.15),
                                   (f"{m} B=1 verify 5 / decode 1 [{path}]", d5 / d1 if d1 and d5 else None, 1.10)):
            met = None if value is None else value <= limit
            out.append({"check": name, "value": value, "limit": limit, "met": met})
    return out


def steps_table(result: dict) -> str:
    rows = result.get("rows", [])
    lines = [f"card: {result['card']}; copy bandwidth {result['copy']['GBps']:.0f} GB/s; context {result['context']}",
             "| model | B | T | attention | ours graph ms | floor ms | x floor | ours eager ms | HF eager ms "
             "| HF compiled ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    order = {a: i for i, a in enumerate(_attentions(rows))}
    # One row per (model, B, T) and attention variant of ours; HF-only shapes get one row (attention '-').
    ours_impls = ("ours-graph", "ours-eager")
    keys = {(r["model"], r["B"], r["T"], r.get("attention") if r["impl"] in ours_impls else None) for r in rows}
    keys = {k for k in keys if k[3] is not None or not any(o[:3] == k[:3] and o[3] is not None for o in keys)}
    keys = sorted(keys, key=lambda k: (list(SHAPES).index(k[0]), k[1], k[2], order.get(k[3], -1)))
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for m, B, T, att in keys:
        ours = (_ms(rows, "ours-eager" if att == "eager" else "ours-graph", m, B, T, att)
                if att is not None else None)
        fl = _floor(rows, m, B, T, att)
        eager = next((r["eager_ms"] for r in rows if (r["impl"], r["model"], r["B"], r["T"]) == ("ours-graph", m, B, T)
                      and "eager_ms" in r), None)
        lines.append(f"| {m} | {B} | {T} | {att or '-'} | {f(ours, 3)} | {f(fl, 3)} | "
                     f"{f(ours / fl if ours and fl else None)} | {f(eager)} | {f(_ms(rows, 'hf-eager', m, B, T))} | "
                     f"{f(_ms(rows, 'hf-compiled', m, B, T))} |")
    lines.append("")
    for p in result.get("profile", []):
        lines.append(f"- GPU time of one captured step, {p['model']} B={p['B']} T={p['T']} "
                     f"[{p.get('attention', '-')}]: " + ", ".join(
            f"{k} {v['ms']:.2f} ms ({v['kernels']:.0f} kernels)"
            for k, v in sorted(p["classes"].items(), key=lambda kv: -kv[1]["ms"])))
    for c in result.get("checks", []):
        state = "not measured" if c["met"] is None else ("MET" if c["met"] else "MISSED")
        lines.append(f"- {c['check']}: {f(c['value'], 3)} (target <= {c['limit']}): {state}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# demo


def run_demo(args, result: dict, save: Callable[[], None]) -> None:
    from pipeline.models.store import convert_gguf
    from specserve.prompts import load_prompts
    from specserve.spec_bench import markdown_table, run_bench

    os.environ.setdefault("SPECSERVE_CACHE", "/tmp/specserve-cache")
    folder = convert_gguf(Path(args.gguf))
    log(f"demo target converted: {folder}")
    prompts = load_prompts(args.prompts, args.per_category)
    methods = ["engine-target", "engine-spec", "hf-generate", "hf-assisted"]
    # Warm-up: compile this model's shapes once in this process (a served engine pays that once, at start).
    run_bench(str(folder), "prompt-lookup", prompts[:: args.per_category], methods[:2], args.k, args.max_tokens,
              device=args.device, progress=False)
    bench = run_bench(str(folder), "prompt-lookup", prompts, methods, args.k, args.max_tokens, device=args.device,
                      progress=False)
    result["demo"] = bench
    result["demo_table"] = markdown_table(bench)
    log("\n" + result["demo_table"])
    save()
    try:
        result["concurrent"] = run_concurrent(str(folder), args)
    except Exception:  # noqa: BLE001
        result.setdefault("errors", []).append(f"concurrent: {traceback.format_exc()}")
        log(traceback.format_exc())
    save()


def run_concurrent(folder: str, args) -> dict:
    """32 requests at once through one engine (continuous batching): off, fixed K, adaptive K."""
    from pipeline.adaptive import AdaptiveK
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import PromptLookupDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from specserve.prompts import load_prompts

    n = args.concurrent
    model, tok = load_model(folder, device=args.device, dtype=args.demo_dtype)
    engine = SpeculativeEngine(model, tok, None, EngineConfig(max_batch_size=n, max_seq_len=2048, device=args.device))
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    warm = engine.warmup(args.k) if args.warmup else None  # every step shape captured before any round
    if warm is not None:
        log(f"warm-up: {warm['captures']} graphs captured in {warm['seconds']:.1f} s")
    gc_pause = _GcClock()
    by_cat: dict[str, list] = {}
    for s in load_prompts(args.prompts, 100):
        by_cat.setdefault(s.category, []).append(s)
    mixed = [c[i] for i in range(max(map(len, by_cat.values()))) for c in by_cat.values() if i < len(c)]  # round robin
    ids = [engine.encode(s.prompt, chat=True) for s in mixed]
    ids = [p for p in ids if len(p) + args.max_tokens <= 2048][:n]
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    variants = {"off": (None, None), "fixed-K": (PromptLookupDrafter(), None),
                "adaptive-K": (PromptLookupDrafter(), AdaptiveK(max_k=args.k))}
    out: dict[str, Any] = {"requests": len(ids), "max_tokens": args.max_tokens, "dtype": args.demo_dtype, "k": args.k,
                           "repeats": args.repeats}
    outputs = {}
    names = list(variants)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    # One warm-up round (captures, compilation, the policy's first measurements), then `repeats` timed rounds,
    # each in a rotated order so that no variant always runs first or last (clock and thermal drift).
    for rnd in range(args.repeats + 1):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            drafter, policy = variants[name]
            engine.drafter, engine.k_policy = drafter, policy
            stats = getattr(engine.target, "stats", None)
            before = (getattr(stats, "captures", 0), getattr(stats, "capture_s", 0.0), gc_pause.seconds,
                      dict(engine.timings.steps_by_k))
            sync()
            t0 = time.perf_counter()
            res = engine.generate_batch(ids, params, SpecParams(num_draft_tokens=args.k))
            sync()
            dt = time.perf_counter() - t0
            tokens = sum(len(r.token_ids) for r in res)
            passes = sum(r.stats.get("target_passes") or 0 for r in res)
            outputs[name] = [r.token_ids for r in res]
            steps_by_k = {k: c - before[3].get(k, 0) for k, c in engine.timings.steps_by_k.items()
                          if c > before[3].get(k, 0)}
            if rnd > 0:
                runs[name].append({"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
                                   "tokens_per_pass": tokens / passes if passes else None,
                                   "captures": getattr(stats, "captures", 0) - before[0],
                                   "capture_s": getattr(stats, "capture_s", 0.0) - before[1],
                                   "gc_s": gc_pause.seconds - before[2], "steps_by_k": steps_by_k})
                r = runs[name][-1]
                log(f"concurrent round {rnd} {name}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s; "
                    f"captures {r['captures']} ({r['capture_s']:.2f} s), gc {r['gc_s']:.3f} s, steps by K {steps_by_k}")
    for name in names:
        policy = variants[name][1]
        tps = [r["tokens_per_s"] for r in runs[name]]
        out[name] = {"tokens": runs[name][-1]["tokens"], "tokens_per_s": statistics.median(tps),
                     "tokens_per_s_runs": tps, "tokens_per_pass": runs[name][-1]["tokens_per_pass"],
                     "k_costs": {str(k): v for k, v in policy.costs(n).items()} if policy else None,
                     "alpha": policy.alpha if policy else None}
        out[name]["captures"] = sum(r["captures"] for r in runs[name])
        out[name]["capture_s"] = sum(r["capture_s"] for r in runs[name])
        out[name]["gc_s"] = sum(r["gc_s"] for r in runs[name])
        out[name]["rounds"] = runs[name]
        if name != "off":  # paired: each round's ratio to that round's speculation-off run
            ratios = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs[name], runs["off"])]
            out[name]["paired_ratio_median"] = statistics.median(ratios)
            out[name]["paired_ratio_range"] = [min(ratios), max(ratios)]
            # all rounds' tokens over all rounds' time, against the same for speculation off
            out[name]["aggregate_ratio"] = (
                sum(r["tokens"] for r in runs[name]) / sum(r["seconds"] for r in runs[name])
                / (sum(o["tokens"] for o in runs["off"]) / sum(o["seconds"] for o in runs["off"])))
    gc_pause.stop()
    out["warmup"] = warm
    out["outputs_equal"] = outputs["off"] == outputs["fixed-K"] == outputs["adaptive-K"]
    out["graph_stats"] = {"captures": engine.target.stats.captures, "graph_calls": engine.target.stats.graph_calls,
                          "eager_calls": engine.target.stats.eager_calls} if hasattr(engine.target, "stats") else None
    return out


def concurrent_table(c: dict) -> str:
    warm = c.get("warmup")
    lines = [f"{c['requests']} concurrent requests, max_tokens {c['max_tokens']}, {c['dtype']}, prompt lookup, "
             f"K<={c['k']}, "
             f"median of {c.get('repeats', 1)} rotated rounds; warm-up "
             + (f"{warm['captures']} graphs in {warm['seconds']:.1f} s" if warm else "off") + ":",
             "| variant | tokens/s (median) | rounds | x off (paired median) | x off (all rounds) "
             "| tokens per target pass | captures in rounds (s) | gc s |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("off", "fixed-K", "adaptive-K"):
        v = c.get(name)
        if v:
            tpp = "-" if v["tokens_per_pass"] is None else f"{v['tokens_per_pass']:.2f}"
            each = ", ".join(f"{t:.0f}" for t in v.get("tokens_per_s_runs", [v["tokens_per_s"]]))
            ratio, agg = v.get("paired_ratio_median"), v.get("aggregate_ratio")
            lines.append(f"| {name} | {v['tokens_per_s']:.0f} | {each} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                         f"{'-' if agg is None else f'{agg:.3f}'} | {tpp} | {v.get('captures', '-')} "
                         f"({v.get('capture_s', 0.0):.2f}) | {v.get('gc_s', 0.0):.2f} |")
    lines.append(f"outputs identical across variants: {c.get('outputs_equal')}")
    return "\n".join(lines)


class _GcClock:
    """Seconds the garbage collector paused this process while installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def stop(self) -> None:
        if self._tick in gc.callbacks:
            gc.callbacks.remove(self._tick)


# ----------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=["steps", "demo", "all", "hf-compiled", "concurrent"], default="steps")
    p.add_argument("--hf-shape", default="llama-8b", help="(hf-compiled part) model shape")
    p.add_argument("--hf-how", choices=["generate", "direct"], default="generate",
                   help="(hf-compiled part) generate() with a static cache (T=1), or a direct compiled forward (T=K+1)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-bench-out"), help="folder for gpu_bench_<part>.json")
    p.add_argument("--context", type=int, default=512, help="KV positions already in the cache per row")
    p.add_argument("-k", type=int, default=4, help="draft tokens: verify steps feed K+1 tokens")
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--attention", default="auto",
                   help="(steps part) comma-separated graph attention variants to time: auto, triton, sdpa "
                        "(e.g. triton,sdpa: before/after in one run; the first one's checks keep their names)")
    p.add_argument("--hf-batches", default="1,8,32", help="Hugging Face baselines' batches ('' skips HF)")
    p.add_argument("--profile-batches", default="1,16,32",
                   help="8B batches of the per-kernel profile of each variant ('' skips the profile)")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip optional HF compiled runs past this")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="(steps part) comma-separated model shapes (pipeline.models.shapes.SHAPES), in order; "
                        "shapes without a graph path run eager")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="(steps part) no shape or step measurement starts past this many seconds of the run")
    p.add_argument("--gguf", default=None,
                   help="the demo target's GGUF file (demo part), or its converted folder (concurrent part)")
    p.add_argument("--prompts", default=None, help="Spec-Bench jsonl (default: the shipped Spec-Bench dev set)")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="(concurrent part) timed rounds after the warm-up round")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="(concurrent part) capture graphs on first use instead of before the rounds")
    p.add_argument("--demo-dtype", default="float32")
    p.add_argument("--device", default="cuda", help="(demo, steps parts) device of the engine and models")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    if args.prompts is None:
        from specserve.prompts import SPEC_BENCH_DEV

        args.prompts = str(SPEC_BENCH_DEV)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "card": torch.cuda.get_device_name(0), "torch": torch.__version__, "context": args.context, "k": args.k,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    path = out / f"gpu_bench_{args.part}.json"
    save = lambda: path.write_text(json.dumps(result, indent=1, default=str))  # noqa: E731
    log(f"card {result['card']}, torch {result['torch']}")
    if args.part in ("steps", "all"):
        run_steps(args, result, save)
    if args.part in ("demo", "all"):
        run_demo(args, result, save)
    if args.part == "concurrent":
        folder = args.gguf
        if folder and folder.endswith(".gguf"):
            from pipeline.models.store import convert_gguf

            os.environ.setdefault("SPECSERVE_CACHE", "/tmp/specserve-cache")
            folder = str(convert_gguf(Path(folder)))
        result["concurrent"] = run_concurrent(folder, args)
    if args.part == "hf-compiled":
        run_hf_compiled_part(args, result, save)
        return 0
    save()
    print()
    if "rows" in result:
        print(steps_table(result))
    if "demo_table" in result:
        print(result["demo_table"])
    if "concurrent" in result:
        print(concurrent_table(result["concurrent"]))
    for e in result.get("errors", []):
        print("ERROR:", e.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
