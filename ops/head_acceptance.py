"""Tokens per target pass of a drafter through the engine, greedy and sampled, by category and by draft position;
chains and token trees.

    python -m ops.head_acceptance                                   # the shipped EAGLE-3 head, T = 0 and 0.7
    python -m ops.head_acceptance --draft lookup+eagle3:smollm2-135m-eagle3 --per-category 8
    nice python -m ops.head_acceptance --temperatures 0 --trees "2,2,1,1;3,2,2,1:8" --batch 1   # chain and trees

The engine (`SpeculativeEngine`, the demo target unless `--target`) runs the first `--per-category` Spec-Bench dev
prompts of each category (first turn, chat template) at fixed K, EOS honoured, `--batch` requests at a time (batching
changes no output: greedy rows are the target's own, sampled rows are seeded per request, seed = 1000 + prompt index).
Each drafting (the chain of K, then each `--trees` shape, `pipeline.tree_tune.parse_tree`'s BRANCHING[:MAX_NODES] or a
`specserve tune-tree` file, with K = its depth) and temperature gives tokens per target pass (accepted drafts + the
recovered or bonus token, per pass) over all requests and per category, the acceptance rate at each draft position
(a tree's: at each depth; accepted at i / verified at i) and tokens/s (wall clock, the machine's load included).
Tokens per pass are the engine's own counts of real decoding, not the teacher-forced estimate of
`pipeline.distill.evaluate`, and do not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.config import EngineConfig, SamplingParams, SpecParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model (default: the demo target)")
    p.add_argument("--draft", default="eagle3:smollm2-135m-eagle3")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--trees", default="", help="';'-separated tree shapes run after the chain: BRANCHING[:MAX_NODES], "
                   "dyn:BRANCHING:MAX_NODES or FILE.json (a `specserve tune-tree` file)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.tree_tune import parse_tree, tree_name
    from specserve.prompts import SPEC_BENCH_DEV, load_prompts

    samples = load_prompts(SPEC_BENCH_DEV, args.per_category)
    cfg = EngineConfig(max_batch_size=args.batch, max_seq_len=4096, device=args.device)
    engine = SpeculativeEngine.from_pretrained(args.target, args.draft, cfg)
    prompts = [engine.encode(s.prompt, chat=True) for s in samples]
    runs = [(f"chain K={args.k}", engine, args.k)]
    for t in (parse_tree(t) for t in args.trees.split(";") if t):  # a drafter of its own, over the same target
        drafter = build_drafter(args.draft, engine.target.info, engine.tokenizer, args.device, target=engine.target)
        name = tree_name(t)
        runs.append((name, SpeculativeEngine(engine.target, engine.tokenizer, drafter,
                                             dataclasses.replace(cfg, tree=t)), len(t.branching)))
    result: dict = {"draft": args.draft, "k": args.k, "max_tokens": args.max_tokens, "prompts": len(samples),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    outputs: dict[float, list[list[int]]] = {}  # the chain's, per temperature
    for name, eng, k in runs:
        for temp in (float(t) for t in args.temperatures.split(",")):
            run, out = measure(eng, samples, prompts, k, temp, args)
            ref = outputs.setdefault(temp, out)
            # greedy: every drafting emits the target's own tokens (sampled outputs differ by design)
            run.update(drafting=name, temperature=temp, same_as_chain=sum(a == b for a, b in zip(out, ref)))
            result["runs"][f"{name} T={temp}"] = run
            print(f"{name} T={temp}: {json.dumps(run)}", flush=True)
    cats = sorted(next(iter(result["runs"].values()))["by_category"])
    lines = [f"{result['date']}: drafter {args.draft}, {len(samples)} Spec-Bench dev prompts "
             f"({args.per_category} per category, first turn), up to {args.max_tokens} tokens, EOS honoured, batch "
             f"{args.batch}; tokens/s at load average {os.getloadavg()[0]:.1f} (1 min, at the end)", "",
             "| drafting | T | tokens per pass | tokens/s | " + " | ".join(cats)
             + " | acceptance by draft position | outputs equal to the chain's |",
             "|---|---|---|---|" + "---|" * len(cats) + "---|---|"]
    for run in result["runs"].values():
        pos = " / ".join("-" if a is None else f"{a:.2f}" for a in run["acceptance_by_position"])
        lines.append(f"| {run['drafting']} | {run['temperature']} | {run['tokens_per_pass']:.2f} | "
                     f"{run['tokens_per_s']:.1f} | " + " | ".join(f"{run['by_category'][c]:.2f}" for c in cats)
                     + f" | {pos} | {run['same_as_chain']}/{len(samples)} |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_acceptance.json").write_text(json.dumps(result, indent=1))
    (out / "head_acceptance.md").write_text(md)
    return 0


def measure(engine, samples, prompts: list[list[int]], k: int, temp: float, args) -> tuple[dict, list[list[int]]]:
    """One drafting at one temperature over every prompt -> (tokens per pass (all, by category), acceptance by
    draft position, tokens/s; each prompt's output)."""
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # category -> [tokens, passes]
    drafted, accepted = [0] * k, [0] * k
    generated, seconds = 0, 0.0
    outputs: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc=f"T={temp}", unit="request")
    for start in range(0, len(prompts), args.batch):
        idx = range(start, min(start + args.batch, len(prompts)))
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=temp, top_p=args.top_p, seed=1000 + i)
                  for i in idx]
        t0 = time.perf_counter()
        results = engine.generate_batch([prompts[i] for i in idx], params, SpecParams(k))
        seconds += time.perf_counter() - t0
        for i, r in zip(idx, results):
            st = r.stats
            cell = by_cat[samples[i].category]
            cell[0] += st["accepted"] + st["target_passes"]
            cell[1] += st["target_passes"]
            generated += len(r.token_ids)
            outputs[i] = r.token_ids
            for j, (d, a) in enumerate(zip(st["drafted_at"], st["accepted_at"])):
                drafted[j] += d
                accepted[j] += a
        bar.update(len(idx))
    bar.close()
    tokens, passes = sum(c[0] for c in by_cat.values()), sum(c[1] for c in by_cat.values())
    return {"tokens_per_pass": tokens / passes, "tokens_per_s": generated / seconds,
            "by_category": {c: v[0] / v[1] for c, v in sorted(by_cat.items())},
            "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted)]}, outputs


if __name__ == "__main__":
    sys.exit(main())
