"""Token trees against chains with the same draft model: in process, one stream, greedy, on the CPU.

Part 1: accepted tokens per target pass (bonus included) and tokens/s on the first N Spec-Bench dev prompts, the
chain (K) and each tree run per prompt in turn, outputs checked equal to the chain's. Part 2: the target's cost of
verifying a tree of n nodes (one pass over n + 1 tokens with the tree mask) against a chain step of K + 1 tokens, at
a context of `--context` tokens: the median of `--reps` timed passes, interleaved.

    nice -n 10 python -m ops.bench_tree                          # demo pair, 20 prompts, K=4 vs two trees
    python -m ops.bench_tree --trees 3,2,2,1:8 --prompts 5 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pipeline.tree_tune import parse_tree, tree_name

SPEC_BENCH = "/work/shared/data/spec_bench_dev.jsonl"


def verify_costs(target, k: int, trees, context: int, reps: int) -> dict[str, float]:
    """Median seconds of one verify pass: the chain's K + 1 tokens, and each tree's n + 1 tokens with its mask."""
    from pipeline.tree import tree_shape
    from pipeline.tree_tune import verify_seconds

    passes: dict = {f"chain K={k}": k + 1}
    for t in trees:
        shape = tree_shape(t)
        passes[f"{tree_name(t)} ({shape.num_nodes} nodes)"] = shape
    return verify_seconds(target, passes, context, reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=20, help="the first N Spec-Bench dev prompts")
    p.add_argument("--data", default=SPEC_BENCH)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("-k", type=int, default=4, help="the chain's K (and the trees' depth cap)")
    p.add_argument("--trees", default="3,2,2,1:8;4,2,2,1:12",
                   help="';'-separated BRANCHING[:MAX_NODES] or FILE.json (a `specserve tune-tree` file)")
    p.add_argument("--draft", default="smollm2-135m-distill")
    p.add_argument("--context", type=int, default=512, help="context length of the verify-cost part")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench-out/tree.json")
    args = p.parse_args()
    import dataclasses

    import torch

    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import ModelDrafter, build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from pipeline.models.store import resolve

    torch.set_num_threads(args.threads)
    trees = [parse_tree(t) for t in args.trees.split(";")]
    target, tok = load_model(str(resolve(None)))
    drafter = build_drafter(args.draft, target.info, tok)
    assert isinstance(drafter, ModelDrafter), f"{args.draft} is not a draft model"
    config = EngineConfig(max_batch_size=1, max_seq_len=4096)
    engines = {f"chain K={args.k}": SpeculativeEngine(target, tok, drafter, config)}
    for t in trees:
        engines[tree_name(t)] = SpeculativeEngine(
            target, tok, ModelDrafter(drafter.model), dataclasses.replace(config, tree=t))
    prompts = [json.loads(line)["turns"][0] for line in Path(args.data).read_text().splitlines()[: args.prompts]]
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    rows: dict[str, dict[str, float]] = {n: {"tokens": 0, "passes": 0, "seconds": 0.0} for n in engines}
    loads, same = [], 0
    t_start = time.time()
    for i, prompt in enumerate(prompts):
        loads.append(os.getloadavg()[0])
        names = list(engines)
        order = names[i % len(names):] + names[: i % len(names)]
        outs = {}
        for n in order:
            t0 = time.perf_counter()
            r = engines[n].generate(prompt, params, SpecParams(args.k), chat=True)
            rows[n]["seconds"] += time.perf_counter() - t0
            rows[n]["tokens"] += len(r.token_ids)
            rows[n]["passes"] += r.stats["target_passes"]
            outs[n] = r.token_ids
        same += all(o == outs[names[0]] for o in outs.values())
        print(f"prompt {i}: load {loads[-1]:.1f}, " + ", ".join(
            f"{n} {rows[n]['tokens'] / rows[n]['passes']:.2f}" for n in names), file=sys.stderr, flush=True)
    costs = verify_costs(target, args.k, trees, args.context, args.reps)
    head = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}; demo target + {args.draft}; greedy, "
            f"max_tokens={args.max_tokens}, one stream, {args.threads} torch thread(s); first {len(prompts)} "
            f"Spec-Bench dev prompts (chat template); load average (1 min) mean {sum(loads) / len(loads):.2f}, max "
            f"{max(loads):.2f}; outputs equal to the chain's: {same}/{len(prompts)}")
    print(head)
    print("| drafting | tokens per target pass | tokens/s |\n|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['tokens'] / r['passes']:.2f} | {r['tokens'] / r['seconds']:.1f} |")
    base = costs[f"chain K={args.k}"]
    print(f"\nVerify pass at a {args.context}-token context (median of {args.reps}):\n")
    print("| pass | ms | x chain |\n|---|---|---|")
    for n, c in costs.items():
        print(f"| {n} | {c * 1e3:.1f} | {c / base:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"head": head, "rows": rows, "verify_s": costs, "loads": loads}, indent=1))
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
