"""Tokens per target pass of a drafter through the engine, greedy and sampled, by category and by draft position.

    python -m ops.head_acceptance                                   # the shipped EAGLE-3 head, T = 0 and 0.7
    python -m ops.head_acceptance --draft lookup+eagle3:smollm2-135m-eagle3 --per-category 8

The engine (`SpeculativeEngine`, the demo target unless `--target`) runs the first `--per-category` Spec-Bench dev
prompts of each category (first turn, chat template) at fixed K, EOS honoured, `--batch` requests at a time (batching
changes no output: greedy rows are the target's own, sampled rows are seeded per request, seed = 1000 + prompt index).
Each temperature's run gives tokens per target pass (accepted drafts + the recovered or bonus token, per pass) over
all requests and per category, and the acceptance rate at each draft position (accepted at i / verified at i). These
are the engine's own counts of real decoding, not the teacher-forced estimate of `pipeline.distill.evaluate`; the
figures do not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pipeline.engine import SpeculativeEngine
    from specserve.prompts import SPEC_BENCH_DEV, load_prompts

    samples = load_prompts(SPEC_BENCH_DEV, args.per_category)
    cfg = EngineConfig(max_batch_size=args.batch, max_seq_len=4096, device=args.device)
    engine = SpeculativeEngine.from_pretrained(args.target, args.draft, cfg)
    prompts = [engine.encode(s.prompt, chat=True) for s in samples]
    result: dict = {"draft": args.draft, "k": args.k, "max_tokens": args.max_tokens, "prompts": len(samples),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    for temp in (float(t) for t in args.temperatures.split(",")):
        by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # category -> [tokens, passes]
        drafted, accepted = [0] * args.k, [0] * args.k
        bar = tqdm(total=len(prompts), desc=f"T={temp}", unit="request")
        for start in range(0, len(prompts), args.batch):
            idx = range(start, min(start + args.batch, len(prompts)))
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temp, top_p=args.top_p, seed=1000 + i)
                      for i in idx]
            for i, r in zip(idx, engine.generate_batch([prompts[i] for i in idx], params, SpecParams(args.k))):
                st = r.stats
                cell = by_cat[samples[i].category]
                cell[0] += st["accepted"] + st["target_passes"]
                cell[1] += st["target_passes"]
                for j, (d, a) in enumerate(zip(st["drafted_at"], st["accepted_at"])):
                    drafted[j] += d
                    accepted[j] += a
            bar.update(len(idx))
        bar.close()
        tokens, passes = sum(c[0] for c in by_cat.values()), sum(c[1] for c in by_cat.values())
        run = {"tokens_per_pass": tokens / passes,
               "by_category": {c: v[0] / v[1] for c, v in sorted(by_cat.items())},
               "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted)]}
        result["runs"][str(temp)] = run
        print(f"T={temp}: {json.dumps(run)}", flush=True)
    cats = sorted(next(iter(result["runs"].values()))["by_category"])
    lines = [f"{result['date']}: drafter {args.draft}, K={args.k}, {len(samples)} Spec-Bench dev prompts "
             f"({args.per_category} per category, first turn), up to {args.max_tokens} tokens, EOS honoured", "",
             "| T | tokens per pass | " + " | ".join(cats) + " | acceptance by draft position |",
             "|---|---|" + "---|" * len(cats) + "---|"]
    for temp, run in result["runs"].items():
        pos = " / ".join("-" if a is None else f"{a:.2f}" for a in run["acceptance_by_position"])
        lines.append(f"| {temp} | {run['tokens_per_pass']:.2f} | "
                     + " | ".join(f"{run['by_category'][c]:.2f}" for c in cats) + f" | {pos} |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_acceptance.json").write_text(json.dumps(result, indent=1))
    (out / "head_acceptance.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
