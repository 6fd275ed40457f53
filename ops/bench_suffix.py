"""Prompt lookup against suffix decoding on a repetitive agentic-style workload, in process, batch 1, greedy.

The workload is built here, deterministically (seeded): a stream of requests, each a short transcript of JSON tool
calls of an agent (the same few tools, changing arguments) and the instruction to write the next call. Each
request runs after the one before it, on one engine per drafter, so the suffix drafter's store holds the earlier
requests' outputs. Prints one table: target passes, tokens per target pass (bonus included), tokens/s.

    python -m ops.bench_suffix                       # the demo target, 12 requests of up to 64 tokens
    python -m ops.bench_suffix --requests 6 --max-tokens 48 -k 8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

TOOLS = {
    "read_file": lambda g: {"path": f"src/{g.choice(['app', 'db', 'api', 'util'])}/{g.choice(['main', 'models'])}.py"},
    "search": lambda g: {"query": g.choice(["def handler", "class Config", "TODO", "import json"]), "limit": 10},
    "edit_file": lambda g: {"path": f"src/{g.choice(['app', 'api'])}/main.py", "line": g.randrange(10, 200),
                            "replace": g.choice(["return None", "pass", "raise ValueError(msg)"])},
    "run_tests": lambda g: {"path": "tests/", "verbose": True},
}


def workload(n: int, seed: int = 0) -> list[str]:
    """n agent turns: a transcript of 3-5 tool calls, then the request for the next one."""
    g = random.Random(seed)
    prompts = []
    for _ in range(n):
        calls = []
        for _ in range(g.randrange(3, 6)):
            name = g.choice(sorted(TOOLS))
            calls.append(json.dumps({"tool": name, "arguments": TOOLS[name](g)}))
        prompts.append("You are a coding agent. Your tool calls so far, one JSON object a line:\n" + "\n".join(calls)
                       + "\nWrite the next three tool calls in the same JSON format, one a line, and nothing else.")
    return prompts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model (default: the demo model)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from pipeline.config import PROMPT_LOOKUP, SUFFIX, EngineConfig, SamplingParams, SpecParams
    from pipeline.engine import SpeculativeEngine

    torch.set_num_threads(args.threads)
    prompts = workload(args.requests)
    params = SamplingParams(max_tokens=args.max_tokens)
    outputs: dict[str, list[list[int]]] = {}
    rows = []
    for draft in (None, PROMPT_LOOKUP, SUFFIX):
        engine = SpeculativeEngine.from_pretrained(args.target, draft=draft,
                                                   config=EngineConfig(max_batch_size=1, max_seq_len=1024))
        engine.generate("Hello", SamplingParams(max_tokens=4), chat=True)  # warm up, outside the timing
        passes = tokens = 0
        wall = 0.0
        outs = []
        for prompt in prompts:
            t0 = time.perf_counter()
            r = engine.generate(prompt, params, SpecParams(args.num_draft_tokens), chat=True)
            wall += time.perf_counter() - t0
            passes += r.stats["target_passes"]
            tokens += len(r.token_ids)
            outs.append(r.token_ids)
        outputs[draft or "none"] = outs
        rows.append((draft or "target only", passes, tokens / passes, tokens / wall))
        print(f"{rows[-1][0]}: {passes} passes, {tokens} tokens, {wall:.1f} s", file=sys.stderr, flush=True)
    same = all(outputs[d] == outputs["none"] for d in outputs)
    base = rows[0][3]
    print(f"{args.requests} requests, up to {args.max_tokens} tokens, K={args.num_draft_tokens}, greedy, batch 1; "
          f"outputs equal to target-only: {same}")
    print("| drafter | target passes | tokens per pass | tokens/s | x target-only |")
    print("|---|---|---|---|---|")
    for name, passes, per_pass, tps in rows:
        print(f"| {name} | {passes} | {per_pass:.2f} | {tps:.1f} | {tps / base:.2f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
