"""Suffix trees against suffix chains, free of the machine's load: greedy decoding replayed over the target's recorded
outputs, and the CPU cost of a tree pass against a chain pass of the same length.

1. Record (once): the demo target's greedy outputs (chat template, one stream) of `ops.bench_suffix`'s workloads, to
   `--outputs` (default bench-out/suffix-outputs-{max_tokens}.json); an existing file is reused.
2. Replay: for each workload in order, with fresh drafters (the suffix store learns each finished output), every
   step drafts from the committed context, accepts the longest drafted path the recorded output follows (greedy
   acceptance is exactly that) and commits it plus one token: tokens and drafted nodes per target pass, per method
   (prompt lookup, suffix chains, suffix trees) and per max_tokens <= the recorded length.
3. `--pass-cost`: one verify pass of the demo target at a 600-token context, T fed tokens, as a chain and as a tree
   (tree mask, then the accepted path's compaction), interleaved; the first quartile of `--reps` passes.

    nice -n 10 python -m ops.suffix_tree_replay --max-tokens 128 --replay 64,128 --pass-cost
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def record(path: Path, max_tokens: int, per_category: int, agentic: int) -> dict[str, list[dict[str, list[int]]]]:
    import torch

    from ops.agentic_workload import workload
    from ops.bench_suffix import SPEC_BENCH
    from pipeline.config import EngineConfig, SamplingParams
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from pipeline.models.store import resolve
    from specserve.prompts import load_prompts

    torch.set_num_threads(1)
    model, tok = load_model(str(resolve(None)))
    engine = SpeculativeEngine(model, tok, None, EngineConfig(max_batch_size=1, max_seq_len=4096))
    bench = [s for s in load_prompts(SPEC_BENCH, per_category) if s.category in ("summarization", "rag")]
    workloads = {"agentic": [t.prompt for t in workload(agentic)],
                 "summarization": [s.prompt for s in bench if s.category == "summarization"],
                 "rag": [s.prompt for s in bench if s.category == "rag"]}
    out: dict[str, list[dict[str, list[int]]]] = {}
    for wl, prompts in workloads.items():
        out[wl] = []
        for prompt in prompts:
            ids = engine.encode(prompt, chat=True)
            result = engine.generate(ids, SamplingParams(max_tokens=max_tokens))
            out[wl].append({"prompt": ids, "output": result.token_ids})
            print(f"recorded {wl} {len(out[wl])}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def replay(method: str, requests: list[dict[str, list[int]]], max_tokens: int, k: int) -> tuple[int, int, int]:
    """-> (target passes, tokens, drafted nodes) of greedy decoding with `method` over the recorded outputs."""
    from pipeline.drafters import PromptLookupDrafter, ProposeRow
    from pipeline.suffix import SuffixConfig, SuffixDrafter

    drafter = PromptLookupDrafter() if method == "lookup" else SuffixDrafter(SuffixConfig(tree=method == "tree"))
    passes = tokens = nodes = 0
    for i, r in enumerate(requests):
        rid, out, ctx, emitted = str(i), r["output"][:max_tokens], list(r["prompt"]), 0
        while emitted < len(out):
            num = max(min(k, max_tokens - emitted - 1), 0)
            truth = out[emitted:]
            if method == "tree" and num:
                draft, parents = drafter.draft_tree(rid, ctx, num, True)
            else:
                draft = drafter.find([ProposeRow(rid, ctx, num, True)])[0] if num else []
                parents = list(range(-1, len(draft) - 1))
            accepted, node = 0, -1
            while accepted < len(truth) - 1:
                nxt = [n for n in range(len(draft)) if parents[n] == node and draft[n] == truth[accepted]]
                if not nxt:
                    break
                node, accepted = nxt[0], accepted + 1
            ctx += truth[: accepted + 1]
            emitted += accepted + 1
            passes, tokens, nodes = passes + 1, tokens + accepted + 1, nodes + len(draft)
        if method == "lookup":
            drafter.release(rid)
        else:
            drafter.finish(rid, out)
    return passes, tokens, nodes


def pass_cost(reps: int, sizes: tuple[int, ...]) -> None:
    import torch

    from pipeline.models.loader import load_model
    from pipeline.models.store import resolve
    from pipeline.models.tree_attention import TreeMask, compact_indices

    torch.set_num_threads(1)
    model, _ = load_model(str(resolve(None)))
    model.allocate(1, 1024)
    pos, slots = torch.tensor([600]), torch.tensor([0])
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        model.forward(torch.randint(0, 1000, (1, 600)), torch.zeros(1, dtype=torch.int64), slots, 599)
        for _ in range(reps):
            for T in sizes:
                fed = torch.randint(0, 1000, (1, T))
                parents = torch.tensor([[-1, 0] + [0] * (T - 2)])  # the pending token, a node, its siblings
                for kind in ("chain", "tree"):
                    t0 = time.perf_counter()
                    if kind == "chain":
                        model.forward(fed, pos, slots)
                    else:
                        model.forward(fed, pos, slots, tree=TreeMask(parents))
                        src, dst = compact_indices(pos + 1, torch.tensor([[0] + [-1] * (T - 2)]))
                        model.compact(slots, src, dst)
                    times.setdefault((T, kind), []).append(time.perf_counter() - t0)
    for T in sizes:
        chain, tree = (sorted(times[(T, k)])[reps // 4] * 1e3 for k in ("chain", "tree"))
        print(f"| {T} | {chain:.1f} | {tree:.1f} | {tree / chain:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=128, help="recorded output length")
    p.add_argument("--per-category", type=int, default=8)
    p.add_argument("--agentic", type=int, default=12)
    p.add_argument("--outputs", default=None, help="recorded outputs (JSON); recorded if missing")
    p.add_argument("--replay", default="64,128", help="max_tokens values to replay at")
    p.add_argument("--pass-cost", action="store_true")
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args()
    path = Path(args.outputs or f"bench-out/suffix-outputs-{args.max_tokens}.json")
    data = json.loads(path.read_text()) if path.exists() else record(path, args.max_tokens, args.per_category,
                                                                       args.agentic)
    print("| max_tokens | workload | method:K | tokens per target pass | drafted nodes per pass |")
    print("|---|---|---|---|---|")
    for max_tokens in map(int, args.replay.split(",")):
        for wl, requests in data.items():
            for method, k in (("lookup", 4), ("chain", 8), ("tree", 8), ("chain", 16), ("tree", 16)):
                passes, tokens, nodes = replay(method, requests, max_tokens, k)
                print(f"| {max_tokens} | {wl} ({len(requests)}) | {method}:{k} | {tokens / passes:.3f} | "
                      f"{nodes / passes:.2f} |", flush=True)
    if args.pass_cost:
        print("| T fed | chain ms | tree ms | tree / chain |\n|---|---|---|---|")
        pass_cost(args.reps, (3, 4, 5, 9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
