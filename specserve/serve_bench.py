"""Benchmark of the full HTTP pipeline against the core engine in this process, in the same run
(`specserve bench-serve`, specserve/cmd_bench_serve.py).

    specserve bench-serve                        # demo pair, the shipped Spec-Bench prompts, greedy
    specserve bench-serve --threads 2 --concurrency 1,4,16 --out bench-serve

1. One stream: per prompt, the in-process `SpeculativeEngine` (same target, drafter, K, torch threads as
   the target worker) and the same request through HTTP -> Serve ingress -> coordinator -> target worker,
   alternating which goes first, so that machine noise hits both alike. Greedy outputs are compared token
   for token. Reported: tokens/s (total tokens / total request time), TTFT and inter-chunk latency
   percentiles; the ratio HTTP/engine.
2. 1, 4, 16 concurrent HTTP streams: aggregate tokens/s, TTFT and inter-chunk latency percentiles, and
   the engine's batched `generate_batch` tokens/s on the same prompts for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from ray import serve

from deployments.app import build_app
from deployments.ray_env import apply_ray_defaults
from pipeline import envs
from pipeline.config import EngineConfig, SamplingParams, SpecParams, is_head
from pipeline.drafters import HYBRID_PREFIX, draft_model_spec
from pipeline.engine import SpeculativeEngine, default_draft
from pipeline.models.store import resolve
from specserve.cmd_generate import tree_config, tree_draft
from specserve.prompts import load_prompts
from specserve.spec_bench import machine


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    i = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[i]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {f"p{q}": pct(values, q) * 1e3 for q in (50, 90, 99)}


async def http_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    times, ids, spec = [], [], {}
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            if data["choices"]:
                got = data["choices"][0]["token_ids"]
                if got:
                    times.append(time.perf_counter())
                    ids += got
            else:
                spec = data.get("speculation", {})
    end = time.perf_counter()
    return {"ids": ids, "ttft": times[0] - t0 if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
            "seconds": end - t0, "spec": spec}


def engine_stream(engine: SpeculativeEngine, ids: list[int], params: SamplingParams, spec: SpecParams,
                  ) -> dict[str, Any]:
    t0 = time.perf_counter()
    times, out = [], []
    for ev in engine.stream(ids, params, spec):
        if ev.token_ids:
            times.append(time.perf_counter())
            out += ev.token_ids
    end = time.perf_counter()
    return {"ids": out, "ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])], "seconds": end - t0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark with `specserve bench-serve`'s arguments; write serve_bench.json and serve_bench.md
    to args.out, print the tables, return the result."""
    apply_ray_defaults()
    torch.set_num_threads(args.threads)
    target = str(resolve(None))
    tree = tree_config(args) if getattr(args, "tree", None) else None  # the same tree in the engine and the app
    # what `specserve serve` deploys for the demo target; a tree drafts with a 'lookup+WORD' drafter's WORD alone
    draft = tree_draft(tree, args.draft or default_draft(None), serve=True)
    model_part = draft_model_spec(draft)
    if model_part is not None:
        model_path = str(resolve(model_part))
        draft = HYBRID_PREFIX + model_path if draft.startswith(HYBRID_PREFIX) else model_path
    # The engine runs the K policy the coordinator runs (both adapt K per step for greedy requests, unless off; neither
    # with a tree).
    engine = SpeculativeEngine.from_pretrained(
        target, draft, EngineConfig(max_batch_size=16, max_seq_len=2048, tree=tree), adaptive_k=not args.fixed_k)
    samples = load_prompts(args.prompts, args.per_category)
    prompts = [engine.encode(s.prompt, chat=True) for s in samples]
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    spec = SpecParams(args.num_draft_tokens)

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    port = 8000 + os.getpid() % 1000
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    cfg = {"target": {"model": target, "max_seq_len": 2048, "resources": {"torch_threads": args.threads}},
           "drafter": {"draft": draft, "resources": {"torch_threads": args.threads},
                       **({"head_placement": args.head_placement} if is_head(draft) else {})},
           "speculation": {"num_draft_tokens": args.num_draft_tokens},
           "coordinator": {"overlap": not args.no_overlap, "adaptive_k": not args.fixed_k}}
    if tree is not None:
        cfg["drafter"]["tree"] = ({"paths": [list(p) for p in tree.paths]} if tree.paths else
                                  {"branching": list(tree.branching), "max_nodes": tree.max_nodes,
                                   "dynamic": tree.dynamic})
    if getattr(args, "prespec_branches", None) is not None:
        cfg["coordinator"]["prespec_branches"] = args.prespec_branches
    api_key = getattr(args, "api_key", None) or next(iter(envs.SPECSERVE_API_KEY), None)
    cfg["ingress"] = {"api_keys": [api_key] if api_key else []}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    serve.run(build_app(cfg), name="bench", route_prefix="/", logging_config=quiet)
    url = f"http://127.0.0.1:{port}/v1/completions"
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers).json()["data"][0]["id"]

    def body(ids: list[int]) -> dict:
        return {"model": model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "seed": 0,
                "stream": True, "speculation": {"num_draft_tokens": args.num_draft_tokens}}

    async def run_http(batch: list[list[int]]) -> tuple[list[dict], float]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64), headers=headers) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*[http_stream(client, url, body(ids)) for ids in batch])
            return res, time.perf_counter() - t0

    # warm-up both paths
    engine.generate(prompts[0], SamplingParams(max_tokens=8, seed=0), spec)
    asyncio.run(run_http([prompts[0][:32]]))

    # 1. one stream, interleaved with the engine
    single = {"engine": [], "http": []}
    mismatches, pair_ratios = 0, []
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = ("engine", "http") if (i + rep) % 2 == 0 else ("http", "engine")
            got = {}
            for who in order:
                got[who] = (engine_stream(engine, ids, params, spec) if who == "engine"
                            else asyncio.run(run_http([ids]))[0][0])
                single[who].append(got[who])
            mismatches += got["engine"]["ids"] != got["http"]["ids"]
            pair_ratios.append(got["engine"]["seconds"] / got["http"]["seconds"])  # same tokens: time ratio
            print(f"prompt {i}: {len(got['engine']['ids'])} tokens, engine {got['engine']['seconds']:.2f}s, "
                  f"http {got['http']['seconds']:.2f}s", flush=True)

    def agg(rows: list[dict]) -> dict[str, Any]:
        tokens, secs = sum(len(r["ids"]) for r in rows), sum(r["seconds"] for r in rows)
        return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                "ttft_ms": summary_ms([r["ttft"] for r in rows]),
                "itl_ms": summary_ms([g for r in rows for g in r["gaps"]])}

    result: dict[str, Any] = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "target": target,
        "drafter": draft if model_part is None else draft.replace(model_path, Path(model_path).name),
        "head_placement": args.head_placement if is_head(draft) else None, "tree": getattr(args, "tree", None),
        "tree_nodes": getattr(args, "tree_nodes", None),
        "k": args.num_draft_tokens, "max_tokens": args.max_tokens, "threads": args.threads, "prompts": len(prompts),
        # pre-speculation as the coordinator runs it: never with a tree (it drafts chains)
        "overlap": not args.no_overlap and tree is None, "load_average_start": os.getloadavg(),
        "single": {"engine": agg(single["engine"]), "http": agg(single["http"]), "greedy_mismatches": mismatches,
                   "pairs": len(pair_ratios), "ratio_median_of_pairs": statistics.median(pair_ratios)},
        "repeats": args.repeats,
    }
    result["single"]["ratio"] = result["single"]["http"]["tokens_per_s"] / result["single"]["engine"]["tokens_per_s"]
    result["single"]["mean_accepted_tokens"] = statistics.mean(
        r["spec"].get("mean_accepted_tokens", 0) for r in single["http"])
    result["single"]["prespec"] = prespec_summary([r["spec"] for r in single["http"]])
    result["prespec_branches"] = getattr(args, "prespec_branches", None)

    # 2. concurrency
    result["concurrency"] = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        res, wall = asyncio.run(run_http(batch))
        tokens = sum(len(r["ids"]) for r in res)
        t0 = time.perf_counter()
        eng = engine.generate_batch(batch, params, spec)
        eng_wall = time.perf_counter() - t0
        result["concurrency"][c] = {
            "http_tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "ttft_ms": summary_ms([r["ttft"] for r in res]), "itl_ms": summary_ms([g for r in res for g in r["gaps"]]),
            "engine_batch_tokens_per_s": sum(len(r.token_ids) for r in eng) / eng_wall,
        }
        print(f"concurrency {c}: http {tokens / wall:.1f} tok/s", flush=True)
    result["load_average_end"] = os.getloadavg()
    serve.shutdown()
    ray.shutdown()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "serve_bench.md").write_text(md)
    print(md)
    return result


def prespec_summary(specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pre-speculation over the one-stream HTTP requests: steps verified while the next one was pre-speculated, how
    many of those a branch matched (overall and by accepted length), and the coordinator's clocks a step."""
    by: dict[str, list[int]] = {}
    for spec in specs:
        for n, (steps, hits) in (spec.get("prespec_by_accepted") or {}).items():
            by.setdefault(n, [0, 0])
            by[n][0] += steps
            by[n][1] += hits
    steps = sum(int(s.get("target_passes", 0)) for s in specs)
    tries = sum(int(s.get("overlap_tries", 0)) for s in specs)
    hits = sum(int(s.get("overlap_hits", 0)) for s in specs)
    per_step = {key: 1e3 * sum(float(s.get(f"coordinator_{key}", 0.0)) for s in specs) / max(steps, 1)
                for key in ("draft_s", "verify_s", "step_s")}
    return {"steps": steps, "tries": tries, "hits": hits,
            "by_accepted": {n: by[n] for n in sorted(by, key=int)},
            "draft_wait_ms": per_step["draft_s"], "verdict_ms": per_step["verify_s"], "step_ms": per_step["step_s"]}


def tree_words(r: dict[str, Any]) -> str:
    """', tree `3,2,2,1` of 8 nodes' for a run with a tree; '' for chains."""
    if not r.get("tree"):
        return ""
    return f", tree `{r['tree']}`" + (f" of {r['tree_nodes']} nodes" if r.get("tree_nodes") else "")


def markdown(r: dict[str, Any]) -> str:
    s = r["single"]
    lines = [
        f"Machine: {r['machine']}; {r['date']}; target `{Path(r['target']).name}`, drafter {r['drafter']}"
        f"{tree_words(r)}, K={r['k']}, greedy, max_tokens={r['max_tokens']}, {r['prompts']} Spec-Bench prompts, "
        f"torch threads {r['threads']} (engine and target worker), overlap {'on' if r['overlap'] else 'off'}; load "
        f"average {r['load_average_start'][0]:.1f} at start, {r['load_average_end'][0]:.1f} at end.",
        "",
        "| one stream | tokens/s | TTFT p50 / p90 / p99 (ms) | inter-chunk p50 / p90 / p99 (ms) |",
        "|---|---|---|---|",
    ]
    for who in ("engine", "http"):
        a = s[who]
        lines.append(f"| {'core engine, in process' if who == 'engine' else 'HTTP pipeline (Serve)'} | "
                     f"{a['tokens_per_s']:.1f} | {a['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p90']:.0f} / "
                     f"{a['ttft_ms']['p99']:.0f} | {a['itl_ms']['p50']:.1f} / {a['itl_ms']['p90']:.1f} / "
                     f"{a['itl_ms']['p99']:.1f} |")
    lines += [
        "",
        f"HTTP / engine tokens/s: **{s['ratio']:.2f}x** over all tokens, {s['ratio_median_of_pairs']:.2f}x median "
        f"of the {s['pairs']} per-prompt pairs (greedy outputs identical: {s['pairs'] - s['greedy_mismatches']}/"
        f"{s['pairs']}; mean tokens per target pass {s['mean_accepted_tokens']:.2f}).",
        "",
    ]
    pre = s.get("prespec")
    if pre:
        by = ", ".join(f"{n}: {h}/{c}" for n, (c, h) in pre["by_accepted"].items()) or "-"
        lines += [
            f"Pre-speculation ({r.get('prespec_branches') or 'default'} branches): ready drafts {pre['hits']} of "
            f"{pre['steps']} steps ({pre['tries']} pre-speculated); by accepted length (hits/steps) {by}. A step "
            f"{pre['step_ms']:.1f} ms = draft wait {pre['draft_wait_ms']:.1f} + verdict {pre['verdict_ms']:.1f} + "
            "commit.",
            "",
        ]
    lines += [
        "| concurrent streams | HTTP tokens/s | TTFT p50 / p90 / p99 (ms) | inter-chunk p50 / p90 / p99 (ms) "
        "| engine generate_batch tokens/s |",
        "|---|---|---|---|---|",
    ]
    for c, a in r["concurrency"].items():
        lines.append(f"| {c} | {a['http_tokens_per_s']:.1f} | {a['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p90']:.0f} / "
                     f"{a['ttft_ms']['p99']:.0f} | {a['itl_ms']['p50']:.1f} / {a['itl_ms']['p90']:.1f} / "
                     f"{a['itl_ms']['p99']:.1f} | {a['engine_batch_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"
