"""Self-speculation at long contexts on a GPU (MagicDec): step times of an 8B-shaped target and the speedup they give.

    python -m ops.gpu_magicdec --out $OUT          # 32 streams at 4k, 8k (and 16k where the cache fits: H200)
    python -m ops.gpu_magicdec --contexts 8192 --no-engine --out $OUT   # step times only

Per context (the KV cache of B streams of that length, random bf16 values, weights random, `--shape`), on the
graph runner (`pipeline.models.graphs`, CUDA graphs, the Triton split-KV attention):
- decode: a target-only step, T = 1, every row reading its whole context;
- verify: the target's verify pass, T = K+1;
- draft: one self-draft forward, T = 1, reading `sinks` + `window` keys a row (`stream=(window, sinks)`, the
  drafter of `pipeline.self_spec`; the same runner, weights and cache).
From these, with tokens per target pass tau (synthetic acceptance: `--tokens-per-pass`, default the demo target's
measured figure at 8k context, window 512, K = 4, docs/benchmarks.md; and tau for a few per-token acceptances alpha,
tau = sum_{i<=K} alpha^i), the speculation speedup over target-only = tau * decode / (K * draft + verify), and the
break-even tau. The bandwidth floor of each step (bytes read / the card's copy bandwidth) is printed beside it.

`--engine` (default on): real engine runs too, at the K with the best projected speedup: B prompts of random tokens
prefilled (chunked), then greedy decoding of `--max-tokens` tokens per stream, target-only against self-speculation
with **synthetic acceptance** (`synthetic:ALPHA:self:RECORDING`, pipeline.synthetic: the target's own windowed draft
forwards run for their time, and the drafts are the target-only run's recorded output, each position kept with
probability alpha, `--alphas`): tokens/s of the whole batch, ms per step, tokens per target pass. Random weights accept
nothing of their own, hence the synthetic drafts; the embedding margin (`--margin`) keeps the bf16 greedy output
independent of the pass shapes, so the recording stays the target's output. Outputs are checked equal token for
token. Writes `gpu_magicdec.json` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

T0 = time.perf_counter()
# The demo target's tokens per target pass as its own drafter (window 512, 4 sinks, greedy) at 8k context (8,000
# prompt tokens, three Spec-Bench summarization/RAG contexts) by K, measured on the CPU (ops/bench_self_spec.py,
# docs/benchmarks.md "Self-speculation for long contexts"): K = 4 measured (3.89); K = 2, 3 from the K = 4 runs'
# acceptance by position (2.75, 3.43), scaled by the K = 4 measurement over its own such estimate (3.89 / 4.08).
DEMO_TOKENS_PER_PASS = "2:2.6,3:3.3,4:3.9"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() (CUDA events, calls back to back, after warm-up: capture and compilation; on
    the CPU, a smoke test of this script, host wall time)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def speedup(tau: float, k: int, decode: float, draft: float, verify: float) -> float:
    """Speculation over target-only: tau tokens per (K drafts + 1 verify) against one token per decode step."""
    return tau * decode / (k * draft + verify)


def step_times(g, B: int, context: int, ks: list[int], window: int, sinks: int) -> dict:
    dev = g.device
    slots = torch.arange(B, dtype=torch.int64)
    positions = torch.full((B,), context, dtype=torch.int64)
    one = torch.randint(0, g.info.vocab_size, (B, 1), device=dev)
    out = {"decode_ms": time_ms(lambda: g.forward(one, positions, slots), dev),
           "draft_ms": time_ms(lambda: g.forward(one, positions, slots, stream=(window, sinks)), dev),
           "verify_ms": {}}
    for k in ks:
        many = torch.randint(0, g.info.vocab_size, (B, k + 1), device=dev)
        out["verify_ms"][k] = time_ms(lambda: g.forward(many, positions, slots), dev)
    return out


def engine_run(g, B: int, context: int, k: int, max_tokens: int, alphas: list[float], window: int, sinks: int,
               out: Path) -> dict:
    """Target-only against self-speculation with synthetic acceptance (`synthetic:ALPHA:self:RECORDING`: the
    target's own windowed draft forwards, the recorded target-only continuation kept with probability alpha per
    position), greedy, every stream prefilled once (chunked). Each method runs twice from that prefill: the first
    run captures every graph shape it meets (rows drop out as streams finish), the second is timed."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.engine import SpeculativeEngine
    from pipeline.sequence import RequestState
    from pipeline.synthetic import Recording, SyntheticSelfDrafter, expected_tokens_per_pass

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, g.info.vocab_size, (context,), generator=gen).tolist() for _ in range(B)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        rows, chunk = 4, 1024
        for r0 in range(0, B, rows):
            for start in range(0, context - 1, chunk):
                n = min(chunk, context - 1 - start)
                tokens = torch.tensor([p[start:start + n] for p in prompts[r0:r0 + rows]], device=g.device)
                g.forward(tokens, torch.full((tokens.shape[0],), start), torch.arange(r0, r0 + tokens.shape[0]),
                          n - 1)
    sync(g.device)
    log(f"prefill {B} x {context}: {time.perf_counter() - t0:.1f} s")
    # No automatic choice: each run's drafter is the one named.
    cfg = EngineConfig(max_batch_size=B, max_seq_len=context + max_tokens, device=str(g.device), dtype="bfloat16",
                       self_spec_min_context=0)

    def run(drafter, k_run: int) -> tuple[dict, list[list[int]]]:
        engine = SpeculativeEngine(g, None, drafter, cfg)
        spec = SpecParams(k_run)
        for timed in (False, True):
            states = [RequestState(request_id=f"r{i}", prompt_ids=p, eos_token_ids=(),
                                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0))
                      for i, p in enumerate(prompts)]
            if drafter is not None:  # what the engine's prefill does, after the chunked prefill above
                for slot, s in enumerate(states):
                    drafter.assign_slot(s.request_id, slot)
                    drafter.admit(s.request_id, s.context)
            sync(g.device)
            t0, steps = time.perf_counter(), 0
            while not all(s.finished for s in states):
                live = [(s, i) for i, s in enumerate(states) if not s.finished]
                engine.step([s for s, _ in live], [i for _, i in live], spec)
                steps += 1
            sync(g.device)
            wall = time.perf_counter() - t0
            if drafter is not None:
                for s in states:
                    drafter.release(s.request_id)
        tokens = sum(len(s.output_ids) for s in states)
        summary = [s.stats.summary() for s in states]
        stats = {"tokens_per_s": tokens / wall, "steps": steps, "wall_s": wall, "ms_per_step": 1e3 * wall / steps,
                 "tokens_per_pass": statistics.mean(x["mean_accepted_tokens"] for x in summary)}
        return stats, [list(s.output_ids) for s in states]

    base, want = run(None, 0)
    log(f"engine target-only: {base}")
    recording = out / f"magicdec_recording_{context}.json"
    out.mkdir(parents=True, exist_ok=True)
    Recording(prompts, want, g.info.vocab_size).save(recording)
    result: dict = {"target-only": base, "synthetic": {}}
    for alpha in alphas:
        stats, got = run(SyntheticSelfDrafter(g, recording, alpha, window, sinks), k)
        stats.update(alpha=alpha, expected_tokens_per_pass=expected_tokens_per_pass(alpha, k),
                     speedup=stats["tokens_per_s"] / base["tokens_per_s"], outputs_equal=got == want)
        result["synthetic"][alpha] = stats
        log(f"engine synthetic:{alpha}:self K={k}: {stats}")
    recording.unlink()  # the prompts are random tokens: nothing worth keeping
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", default="4096,8192,16384",
                   help="contexts to time; one whose cache does not fit is skipped (16k: an H200)")
    p.add_argument("--ks", default="2,3,4", help="draft lengths K to time (verify passes of K+1 tokens)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--tokens-per-pass", default=DEMO_TOKENS_PER_PASS,
                   help="K:tau,... for the headline speedup (synthetic acceptance; default: the demo target's)")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--alphas", default="0.7,0.8",
                   help="(engine run) synthetic acceptance per drafted position of its self-speculation runs")
    p.add_argument("--margin", type=float, default=512.0,
                   help="the random target's embedding scale (pipeline.models.shapes.embedding_margin: a greedy "
                        "output bf16 rounding does not move, so the recorded continuation stays the target's)")
    p.add_argument("--max-tokens", type=int, default=48, help="(engine run) tokens per stream")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny shapes), no figures")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("pipeline").setLevel(logging.INFO)  # the engine's choice of drafter, in one line

    from pipeline.models.graphs import GraphCausalLM
    from pipeline.models.kernel_timing import copy_GBps
    from pipeline.models.shapes import SHAPES, embedding_margin, kv_bytes_per_token, random_llama, weight_bytes_read
    from pipeline.step import CACHE_SLACK

    a, B = SHAPES[args.shape], args.batch
    ks = [int(k) for k in args.ks.split(",")]
    taus = {int(k): float(t) for k, t in (item.split(":") for item in args.tokens_per_pass.split(","))}
    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if on_cuda else "cpu"
    bw = copy_GBps(dev) if on_cuda else 10.0  # the CPU smoke test: a nominal bandwidth
    log(f"{name}: copy bandwidth {bw:.0f} GB/s; shape {args.shape}, B={B}, K={ks}, window {args.window}, "
        f"sinks {args.sinks}")
    alphas = [float(x) for x in args.alphas.split(",")]
    runner = embedding_margin(random_llama(a, dev, torch.bfloat16), args.margin)
    g = GraphCausalLM(runner)
    kv_tok, weights = kv_bytes_per_token(a), weight_bytes_read(a)
    result: dict = {"device": name, "shape": args.shape, "batch": B, "ks": ks, "window": args.window,
                    "sinks": args.sinks, "copy_GBps": bw, "tokens_per_pass": taus, "contexts": {}}
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        max_len = context + args.max_tokens + CACHE_SLACK
        need = (B + 1) * max_len * kv_tok
        g.allocate(1, 1)  # free the previous context's cache (and its graphs) first
        if on_cuda:
            torch.cuda.empty_cache()
        free_b = torch.cuda.mem_get_info(dev)[0] if on_cuda else 1e12
        if need > free_b - 6e9:  # room for activations, graphs and the engine's logits
            log(f"context {context}: skipped, its cache needs {need / 1e9:.1f} GB and {free_b / 1e9:.1f} GB are free")
            result["contexts"][context] = {"skipped": f"cache {need / 1e9:.1f} GB, free {free_b / 1e9:.1f} GB"}
            continue
        g.allocate(B, max_len)
        with torch.no_grad():
            for cache in g.runner.k_caches + g.runner.v_caches:
                cache.normal_()
        t = step_times(g, B, context, ks, args.window, args.sinks)
        floor = {"decode_ms": (weights + B * context * kv_tok) / bw / 1e6,
                 "draft_ms": (weights + B * min(context, args.window + args.sinks) * kv_tok) / bw / 1e6}
        r = {**t, "floor": floor, "by_k": {}}
        for k in ks:
            verify = t["verify_ms"][k]
            r["by_k"][k] = {
                "break_even_tokens_per_pass": (k * t["draft_ms"] + verify) / t["decode_ms"],
                "speedup_demo_tau": speedup(taus[k], k, t["decode_ms"], t["draft_ms"], verify) if k in taus else None,
                "speedup_by_alpha": {al: speedup(sum(al**i for i in range(k + 1)), k, t["decode_ms"], t["draft_ms"],
                                                 verify) for al in (0.6, 0.7, 0.8)}}
        log(f"context {context}: {json.dumps(r)}")
        best = max((k for k in ks if k in taus), key=lambda k: r["by_k"][k]["speedup_demo_tau"], default=ks[-1])
        if args.engine:
            try:
                r["engine"] = engine_run(g, B, context, best, args.max_tokens, alphas, args.window, args.sinks,
                                         Path(args.out))
                r["engine"]["k"] = best
            except Exception as e:  # noqa: BLE001 - the step times above stand; the engine run's error is reported
                r["engine"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                log(f"engine run failed: {r['engine']['error']}")
        result["contexts"][context] = r
        rows.append((context, r))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_magicdec.json").write_text(json.dumps(result, indent=1))
    print(table(result, rows))
    return 0


def table(result: dict, rows: list) -> str:
    lines = [f"{result['device']}, {result['shape']} bf16 (random weights), {result['batch']} streams, self-draft "
             f"window {result['window']} + {result['sinks']} sinks; tau: tokens per target pass (synthetic: the demo "
             "target's, measured on the CPU)", "",
             "| context | K | decode ms (floor) | draft ms (floor) | verify ms | break-even tau | tau (demo) | "
             "speedup at demo tau | speedup at alpha 0.6 / 0.7 / 0.8 |", "|---|---|---|---|---|---|---|---|---|"]
    taus = result["tokens_per_pass"]
    for context, r in rows:
        for k, x in r["by_k"].items():
            by, sp = x["speedup_by_alpha"], x["speedup_demo_tau"]
            lines.append(f"| {context} | {k} | {r['decode_ms']:.2f} ({r['floor']['decode_ms']:.2f}) | "
                         f"{r['draft_ms']:.2f} ({r['floor']['draft_ms']:.2f}) | {r['verify_ms'][k]:.2f} | "
                         f"{x['break_even_tokens_per_pass']:.2f} | {taus.get(k, '-')} | "
                         f"{'-' if sp is None else f'{sp:.2f}x'} | {by[0.6]:.2f}x / {by[0.7]:.2f}x / {by[0.8]:.2f}x |")
    engine_rows = [(c, r["engine"]) for c, r in rows if "engine" in r and "error" not in r["engine"]]
    if engine_rows:
        lines += ["", "Engine runs (greedy, random weights; self-speculation with **synthetic acceptance**: the "
                  "target's own windowed drafts for the time, the recorded target-only continuation kept with "
                  "probability alpha per position):", "",
                  "| context | drafter | K | tokens/s (all streams) | ms per step | tokens per target pass "
                  "(expected) | x target-only | output = target-only |", "|---|---|---|---|---|---|---|---|"]
        for context, e in engine_rows:
            x = e["target-only"]
            lines.append(f"| {context} | none | 0 | {x['tokens_per_s']:.0f} | {x['ms_per_step']:.2f} | 1.00 | 1.00x "
                         "| - |")
            for alpha, x in e["synthetic"].items():
                lines.append(f"| {context} | synthetic:{alpha}:self | {e['k']} | {x['tokens_per_s']:.0f} | "
                             f"{x['ms_per_step']:.2f} | {x['tokens_per_pass']:.2f} "
                             f"({x['expected_tokens_per_pass']:.2f}) | **{x['speedup']:.2f}x** | "
                             f"{x['outputs_equal']} |")
    for context, r in result["contexts"].items():
        if "skipped" in r:
            lines.append(f"\ncontext {context} skipped: {r['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
