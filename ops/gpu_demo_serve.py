"""The demo pair (real weights) through the Serve/HTTP path against the in-process engine, one command, one table.

    BENCH_MODULE=ops.gpu_demo_serve ops/gpu_serve_bench.sh --gguf-parts '/tmp/gguf-part-*' --out $OUT   # on a GPU
    python -m ops.gpu_demo_serve --device cpu --prompts 2 --max-tokens 32                 # a dry run on the CPU

The demo target is SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized; `--dtype`, float32 by default), the drafter
what `specserve serve` deploys for it (`default_draft`: prompt lookup, then the shipped EAGLE-3 head) or
`--draft`. The GGUF (98 MB) is over what one device call carries (64 MiB with the 28 MiB tree; the Serve bundle
is another 34 MB): split it here (`split -b 33M -d FILE DIR/gguf-part-`, DIR ignored by git), bring one part per
call and copy it to /tmp there, then run this with the bundle; `--gguf-parts GLOB` joins the parts (sorted by name)
into the cache's `gguf/` folder and checks the sha256, so `resolve(None)` finds it as on any machine. Fixed K (no
K policy, in the engine and the coordinator alike), the first turn of `--prompts` Spec-Bench prompts (one per
category, in the chat template), `--max-tokens` each, EOS honoured, one request after another:

1. In process (`SpeculativeEngine`, what `specserve generate` runs, its graphs captured first): per prompt,
   target-only (K = 0) and speculative (K). Then `specserve generate --json` itself on the first prompt, as a
   subprocess.
2. Through HTTP (`specserve serve`'s app, target and drafter replicas sharing the GPU, embedded Redis), with the
   `openai` client: per prompt, target-only (`speculation.num_draft_tokens: 0`) and speculative; two seeded sampled
   requests, twice. One app deploy and run per `--steps-per-call` value (`coordinator.steps_per_call`: passes one
   target-worker call may run where the worker needs nothing from elsewhere between them, a feature head in the
   target or no drafts).

Greedy outputs must all equal the in-process target-only output token for token (in float32 the engine's greedy
token does not depend on the pass shape). Prints one table; writes demo_serve.json and demo_serve.md to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ops.gpu_serve_bench import http_one, log, pct, slots_freed, worker_actors, worker_stats
from pipeline.config import EngineConfig, SamplingParams, SpecParams

DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def join_parts(pattern: str, dest: Path, sha256: str) -> None:
    """The GGUF from its parts (sorted by name), checked against its sha256."""
    import glob

    parts = sorted(glob.glob(pattern))
    if not parts:
        raise FileNotFoundError(f"no GGUF parts match {pattern!r}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            data = Path(part).read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != sha256:
        raise ValueError(f"the joined GGUF ({len(parts)} parts) has sha256 {h.hexdigest()}, expected {sha256}")
    os.replace(tmp, dest)
    log(f"GGUF joined from {len(parts)} parts: {dest} ({dest.stat().st_size} bytes)")


def summary(rows: list[dict], tokens_per_pass: float) -> dict[str, Any]:
    tokens, secs = sum(len(r["ids"]) for r in rows), sum(r["seconds"] for r in rows)
    gaps = [g for r in rows for g in r["gaps"]]
    return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs, "tokens_per_pass": tokens_per_pass,
            "ttft_ms_p50": 1e3 * pct([r["ttft"] for r in rows], 50), "itl_ms_p50": 1e3 * pct(gaps, 50),
            "itl_ms_p99": 1e3 * pct(gaps, 99)}


def engine_one(engine, ids: list[int], params: SamplingParams, spec: SpecParams) -> dict:
    t0 = time.perf_counter()
    times, out, gaps, res = [], [], [], None
    for ev in engine.stream(ids, params, spec):
        if ev.token_ids:
            now = time.perf_counter()
            if times:
                gaps += [(now - times[-1]) / len(ev.token_ids)] * len(ev.token_ids)
            times.append(now)
            out += ev.token_ids
        if ev.result is not None:
            res = ev.result
    return {"ids": out, "ttft": times[0] - t0, "gaps": gaps, "seconds": time.perf_counter() - t0,
            "passes": res.stats["target_passes"]}


def in_process(args, target: str, draft: str, texts: list[str]) -> dict:
    """-> the rows of both runs, and the prompts' token ids (the chat template applied, as `specserve generate
    --chat` does)."""
    from pipeline.engine import SpeculativeEngine

    cfg = EngineConfig(max_batch_size=1, max_seq_len=args.max_seq_len, device=args.device, dtype=args.dtype)
    engine = SpeculativeEngine.from_pretrained(target, draft, cfg, adaptive_k=False)
    log(f"in-process engine loaded; warm-up: {engine.warmup(args.k)}")
    prompts = [engine.encode(t, chat=True) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    engine.generate(prompts[0], SamplingParams(max_tokens=8, seed=0), SpecParams(args.k))  # the eager prefill path
    engine.generate(prompts[0], SamplingParams(max_tokens=8, seed=0), SpecParams(0))
    out: dict[str, Any] = {"prompt_ids": prompts}
    for name, k in (("target_only", 0), ("spec", args.k)):
        rows = [engine_one(engine, p, params, SpecParams(k)) for p in prompts]
        out[name] = summary(rows, sum(len(r["ids"]) for r in rows) / sum(r["passes"] for r in rows))
        out[name]["ids"] = [r["ids"] for r in rows]
        log(f"in-process {name}: {out[name]['tokens_per_s']:.1f} tok/s, {out[name]['tokens_per_pass']:.2f} tokens/pass")
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def cli_generate(args, target: str, draft: str, prompt: str) -> list[int]:
    """`specserve generate --json` on one prompt, in its own process: -> its token ids."""
    cmd = [sys.executable, "-m", "specserve", "generate", "--json", "--chat", "--prompt", prompt, "--target", target,
           "--draft", draft, "-k", str(args.k), "--fixed-k", "--max-tokens", str(args.max_tokens),
           "--device", args.device, "--dtype", args.dtype, "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"specserve generate failed: {proc.stderr.strip()[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]


def through_http(args, target: str, draft: str, prompts: list[list[int]], steps_per_call: int) -> dict:
    from deployments.ray_env import apply_ray_defaults

    apply_ray_defaults()
    import ray
    from ray import serve

    from deployments.app import build_app

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    share = 0.5 if gpus else 0.0
    ray.init(address="local", num_gpus=min(gpus, 1), num_cpus=max(os.cpu_count() or 2, 4), include_dashboard=False,
             logging_level="WARNING")
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    port = 8000
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    cfg = {"target": {"model": target, "device": args.device, "dtype": args.dtype, "max_batch_size": 4,
                      "max_seq_len": args.max_seq_len, "resources": {"num_gpus": share, "num_cpus": 1}},
           "drafter": {"draft": draft, "device": args.device, "dtype": args.dtype, "max_batch_size": 4,
                       "resources": {"num_gpus": share, "num_cpus": 1}},
           "speculation": {"num_draft_tokens": args.k},
           "coordinator": {"adaptive_k": False, "steps_per_call": steps_per_call}}
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name="demo", route_prefix="/", logging_config=quiet)
        out["start_s"] = time.perf_counter() - t0
        log(f"serve up in {out['start_s']:.1f} s")
        url = f"http://127.0.0.1:{port}/v1"

        async def go() -> None:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            model = (await client.models.list()).data[0].id
            actors = worker_actors()
            try:
                for k in (args.k, 0):  # warm-up: the eager prefill path for these prompt lengths
                    await http_one(client, model, prompts[0], 8, k, ignore_eos=False)
                    await slots_freed(actors)
                for name, k in (("target_only", 0), ("spec", args.k)):
                    before = worker_stats(actors)
                    rows = []
                    for p in prompts:
                        rows.append(await http_one(client, model, p, args.max_tokens, k, ignore_eos=False))
                        await slots_freed(actors)
                    after = worker_stats(actors)
                    passes = sum(r["spec"].get("target_passes", 0) for r in rows)
                    out[name] = summary(rows, sum(len(r["ids"]) for r in rows) / passes if passes else float("nan"))
                    out[name]["ids"] = [r["ids"] for r in rows]
                    for role in after:
                        b = after[role]["batches"] - before.get(role, {}).get("batches", 0)
                        cs = after[role]["compute_s"] - before.get(role, {}).get("compute_s", 0.0)
                        out[name][f"{role}_compute_ms_per_pass"] = 1e3 * cs / b if b else float("nan")
                        out[name][f"{role}_passes"] = b
                    log(f"http {name}: {out[name]['tokens_per_s']:.1f} tok/s, {out[name]['tokens_per_pass']:.2f} "
                        f"tokens/pass")
                replays = []
                for _ in range(2):
                    ids = []
                    for j, p in enumerate(prompts[:2]):
                        ids.append((await http_one(client, model, p, 48, args.k, temperature=0.8, seed=7 + j,
                                                   ignore_eos=False))["ids"])
                        await slots_freed(actors)
                    replays.append(ids)
                out["sampled_replay_identical"] = replays[0] == replays[1]
            finally:
                await client.close()

        asyncio.run(go())
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def http_label(where: str) -> str:
    """'http-8' -> 'HTTP, 8 steps a call'."""
    n = int(where.split("-")[1])
    return f"HTTP, {n} step{'s' if n > 1 else ''} a call"


def table(r: dict) -> str:
    ref = r["in_process"]["target_only"]["ids"]
    lines = [f"{r['card']}, {r['date']}; demo target SmolLM2-135M-Instruct ({r['dtype']}), drafter {r['draft']}, "
             f"K={r['k']} fixed, greedy, {r['prompts']} Spec-Bench prompts (first turn, chat template), up to "
             f"{r['max_tokens']} tokens each, one after another.", "",
             "| path | tokens/s | x target-only (same path) | tokens per target pass | TTFT p50 ms | "
             "ITL p50 / p99 ms | greedy = in-process target-only |", "|---|---|---|---|---|---|---|"]
    for where in ("in_process", *r.get("http_runs", [])):
        part = r.get(where) or {}
        for name in ("target_only", "spec"):
            x = part.get(name)
            if x is None:
                continue
            same = sum(a == b for a, b in zip(x["ids"], ref))
            base = part["target_only"]["tokens_per_s"]
            lines.append(f"| {'in process' if where == 'in_process' else http_label(where)}, "
                         f"{'target only' if name == 'target_only' else 'speculative'} | {x['tokens_per_s']:.1f} | "
                         f"{x['tokens_per_s'] / base:.2f} | {x['tokens_per_pass']:.2f} | {x['ttft_ms_p50']:.1f} | "
                         f"{x['itl_ms_p50']:.2f} / {x['itl_ms_p99']:.2f} | {same}/{len(ref)} |")
    for where in r.get("http_runs", []):
        http = r.get(where) or {}
        if "spec" not in http:
            continue
        ip = r["in_process"]
        spec = http["spec"]["tokens_per_s"] / ip["spec"]["tokens_per_s"]
        base = http["target_only"]["tokens_per_s"] / ip["target_only"]["tokens_per_s"]
        lines.append(f"\n{http_label(where)} / in process: speculative {spec:.2f}, target-only {base:.2f}. Seeded "
                     f"sampled requests replay identically: {http.get('sampled_replay_identical')}; app up in "
                     f"{http['start_s']:.1f} s; target worker ms a pass (target-only / speculative): "
                     f"{http['target_only'].get('target_compute_ms_per_pass', float('nan')):.2f} / "
                     f"{http['spec'].get('target_compute_ms_per_pass', float('nan')):.2f}.")
    if "cli_equal" in r:
        lines.append(f"`specserve generate` on the first prompt = in-process target-only: {r['cli_equal']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf-parts", default=None, help="glob of the GGUF's parts, joined (sorted by name) first")
    p.add_argument("--gguf-sha256", default=DEMO_GGUF_SHA256)
    p.add_argument("--draft", default=None, help="default: what `specserve serve` deploys for the demo target")
    p.add_argument("--prompts-file", default=None, help="Spec-Bench jsonl (default: the shipped dev prompts)")
    p.add_argument("--prompts", type=int, default=6, help="how many prompts (one per category, in order)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-cli", action="store_true", help="skip the `specserve generate` subprocess")
    p.add_argument("--steps-per-call", default="8",
                   help="comma list: one HTTP run (app deploy) per value of coordinator.steps_per_call")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from pipeline.drafters import HYBRID_PREFIX, draft_model_spec
    from pipeline.engine import default_draft
    from pipeline.models.store import DEMO_GGUF_MEMBER, cache_root, resolve
    from specserve.prompts import SPEC_BENCH_DEV, load_prompts

    if args.gguf_parts:
        join_parts(args.gguf_parts, cache_root() / "gguf" / Path(DEMO_GGUF_MEMBER).name, args.gguf_sha256)
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    log(f"{card}, torch {torch.__version__}")
    target = str(resolve(None))
    draft = args.draft or default_draft(None)
    model_part = draft_model_spec(draft)
    if model_part is not None:  # the drafter's model by path, as serve_bench passes it
        path = str(resolve(model_part))
        draft = HYBRID_PREFIX + path if draft.startswith(HYBRID_PREFIX) else path
    samples = load_prompts(args.prompts_file or SPEC_BENCH_DEV, 1)[: args.prompts]
    result: dict[str, Any] = {"card": card, "date": time.strftime("%Y-%m-%d %H:%M"), "dtype": args.dtype,
                              "draft": args.draft or default_draft(None), "k": args.k, "max_tokens": args.max_tokens,
                              "prompts": len(samples), "argv": sys.argv}
    result["in_process"] = in_process(args, target, draft, [s.prompt for s in samples])
    prompts = result["in_process"].pop("prompt_ids")
    if not args.no_cli:
        try:
            got = cli_generate(args, target, draft, samples[0].prompt)
            result["cli_equal"] = got == result["in_process"]["target_only"]["ids"][0]
        except Exception as err:  # noqa: BLE001 - report it, go on with HTTP
            result["cli_equal"] = f"error: {err!r}"[:300]
        log(f"specserve generate = in-process target-only: {result['cli_equal']}")
    (out / "demo_serve.json").write_text(json.dumps(result, indent=1, default=str))
    result["http_runs"] = [f"http-{n}" for n in args.steps_per_call.split(",")]
    for where in result["http_runs"]:
        try:
            result[where] = through_http(args, target, draft, prompts, int(where.split("-")[1]))
        except Exception as err:  # noqa: BLE001 - report what ran
            import traceback

            traceback.print_exc()
            result[where] = {"error": repr(err)[:300]}
        (out / "demo_serve.json").write_text(json.dumps(result, indent=1, default=str))
    md = table(result)
    (out / "demo_serve.md").write_text(md)
    print(md, flush=True)
    ref = result["in_process"]["target_only"]["ids"]
    ok = all(result[where][name]["ids"] == ref for where in ("in_process", *result["http_runs"])
             for name in ("target_only", "spec")
             if name in (result.get(where) or {}))
    log(f"greedy outputs all equal the in-process target-only output: {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
