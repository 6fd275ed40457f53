"""Suffix decoding against prompt lookup and target-only decoding: in process, one stream, greedy, on the CPU.

Two workloads: Spec-Bench dev's summarization and RAG prompts (the first N of each), and the repetitive agentic
workload of `ops.agentic_workload` (tool-call transcripts, code edits, repeated JSON). Every method runs every
prompt in the same process, one after another, the order rotating from prompt to prompt, so a loaded machine's
noise hits all of them alike; the load average is sampled before every prompt and reported. Each workload starts
with fresh drafters: the suffix drafter's store holds the outputs of the workload's earlier requests only.

Prints one markdown table (tokens/s, tokens per target pass, x target-only, x prompt lookup) and writes the
records to `--out` (default `bench-out/suffix.json`). Greedy outputs are checked token for token against
target-only decoding; the exit status is 1 if any differs.

    nice -n 10 python -m ops.bench_suffix          # 8 + 8 Spec-Bench prompts, 12 agentic, 64 tokens, ~9 minutes
    python -m ops.bench_suffix --per-category 4 --agentic 6 --methods none,prompt-lookup:4,suffix:8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from ops.agentic_workload import workload

SPEC_BENCH = "/work/shared/data/spec_bench_dev.jsonl"


def parse_methods(text: str) -> list[tuple[str, int]]:
    """'none,prompt-lookup:4,suffix:8' -> [('none', 0), ('prompt-lookup', 4), ('suffix', 8)]."""
    out = []
    for part in text.split(","):
        name, _, k = part.partition(":")
        out.append((name, int(k) if k else (0 if name == "none" else 4)))
    return out


def summarize(records: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per workload and method: tokens/s (tokens over summed wall time), tokens per target pass."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for wl in dict.fromkeys(r["workload"] for r in records):
        out[wl] = {}
        for m in methods:
            rows = [r for r in records if r["workload"] == wl and r["method"] == m]
            tokens, secs = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
            passes = sum(r["target_passes"] for r in rows)
            out[wl][m] = {"tokens_per_s": tokens / secs, "tokens_per_pass": tokens / passes, "tokens": tokens}
    return out


def markdown(summary: dict[str, dict[str, dict[str, float]]], methods: list[str]) -> str:
    lines = ["| workload | method | tokens/s | tokens per target pass | x target-only | x prompt lookup |",
             "|---|---|---|---|---|---|"]
    for wl, by_method in summary.items():
        base = by_method.get("none", {}).get("tokens_per_s")
        lookup = max((v["tokens_per_s"] for m, v in by_method.items() if m.startswith("prompt-lookup")), default=None)
        for m in methods:
            s = by_method[m]
            x_base = f"{s['tokens_per_s'] / base:.2f}" if base else "-"
            x_lookup = f"{s['tokens_per_s'] / lookup:.2f}" if lookup else "-"
            lines.append(f"| {wl} | {m} | {s['tokens_per_s']:.1f} | {s['tokens_per_pass']:.2f} | {x_base} | "
                         f"{x_lookup} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model (default: the demo model)")
    p.add_argument("--prompts", default=SPEC_BENCH, help="Spec-Bench jsonl")
    p.add_argument("--per-category", type=int, default=8, help="Spec-Bench prompts per category (summarization, rag)")
    p.add_argument("--agentic", type=int, default=12, help="agentic-workload requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--methods", default="none,prompt-lookup:4,prompt-lookup:8,suffix:8",
                   help="comma list of DRAFT:K (none = target only)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a loaded machine two threads wait on each other)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-time budget: each workload stops starting prompts after its share (at least 2 run)")
    p.add_argument("--out", default="bench-out/suffix.json")
    args = p.parse_args()
    import torch

    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from pipeline.models.store import resolve
    from specserve.prompts import load_prompts

    torch.set_num_threads(args.threads)
    methods = parse_methods(args.methods)
    names = [f"{d}:{k}" if d != "none" else "none" for d, k in methods]
    model, tok = load_model(str(resolve(args.target)))
    config = EngineConfig(max_batch_size=1, max_seq_len=4096)
    bench = [s for s in load_prompts(args.prompts, args.per_category) if s.category in ("summarization", "rag")]
    workloads = {
        "spec-bench summarization": [s.prompt for s in bench if s.category == "summarization"],
        "spec-bench rag": [s.prompt for s in bench if s.category == "rag"],
        "agentic": [t.prompt for t in workload(args.agentic)],
    }
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    records: list[dict[str, Any]] = []
    loads: list[float] = []
    mismatches = 0
    t_start = time.time()
    for wl, prompts in workloads.items():
        engines = {n: SpeculativeEngine(model, tok, None if d == "none" else build_drafter(d, model.info, tok), config)
                   for n, (d, _) in zip(names, methods)}
        first = next(iter(engines.values()))
        first.generate("Hello", SamplingParams(max_tokens=4), chat=True)  # first-call overheads, outside timing
        t_wl = time.time()
        for i, prompt in enumerate(prompts):
            if i >= 2 and time.time() - t_wl > args.budget_s / len(workloads):
                print(f"{wl}: budget spent after {i} of {len(prompts)} prompts", file=sys.stderr, flush=True)
                break
            ids = first.encode(prompt, chat=True)
            loads.append(os.getloadavg()[0])
            outs = {}
            order = names[i % len(names):] + names[: i % len(names)]  # rotate: no method always runs first
            for n in order:
                k = methods[names.index(n)][1]
                t0 = time.perf_counter()
                r = engines[n].generate(ids, params, SpecParams(num_draft_tokens=k))
                dt = time.perf_counter() - t0
                outs[n] = r.token_ids
                records.append({"workload": wl, "prompt": i, "method": n, "prompt_tokens": len(ids),
                                "tokens": len(r.token_ids), "seconds": dt, "target_passes": r.stats["target_passes"]})
            same = all(o == outs["none"] for o in outs.values()) if "none" in outs else True
            mismatches += not same
            print(f"{wl} {i}: {len(ids)} prompt tokens, load {loads[-1]:.2f}, "
                  + ", ".join(f"{n} {r['tokens'] / r['seconds']:.1f} tok/s" for n, r in
                              zip(order, records[-len(order):])), file=sys.stderr, flush=True)
    summary = summarize(records, names)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    head = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}; {cpu}, {os.cpu_count()} cores, "
            f"{args.threads} torch threads (torch {torch.__version__}); greedy, max_tokens={args.max_tokens}, one "
            f"stream; load average (1 min) over the run: mean {sum(loads) / len(loads):.2f}, max {max(loads):.2f}; "
            f"outputs equal to target-only: {len(records) // len(names) - mismatches}/{len(records) // len(names)}; "
            "prompts run: " + ", ".join(f"{wl} {len({r['prompt'] for r in records if r['workload'] == wl})}"
                                        for wl in workloads))
    print(head)
    print(markdown(summary, names))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"head": head, "summary": summary, "records": records, "loads": loads}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
