"""What a token tree costs the target on the captured GPU path: a verify pass over n + 1 tokens fed as a tree (its
mask, RoPE by depth) against a chain of the same length and against the chain step of K = 4 (T = 5), plus the
captured `compact` that keeps the accepted path. Random weights (costs do not depend on them), batch 1, a context of
`--context` tokens, host tensors for positions and slots as the engine passes them.

    python -m ops.gpu_tree_bench                                     # demo shape (float32) and 8B shape (bf16)
    python -m ops.gpu_tree_bench --shapes smollm2-135m:float32 --nodes 4,8,12,24 --out $OUT
    python -m ops.gpu_tree_bench --part engine       # a whole step: the engine with an EAGLE-3 head, chain vs trees

Per shape and T: `step_ms` = one `forward` call as the engine makes it (host work + replay + the logits copy),
median of CUDA-event-timed calls back to back; `replay_ms` = the captured graph alone. The tree is the budgeted
breadth-first tree of `--branching` (`pipeline.tree.tree_shape`). Writes `tree_costs_<shape>.json` per shape: the
verify cost table (`verify_s` by fed tokens) that `specserve tune-tree --costs` reads, and `gpu_tree_bench.md`.

`--part engine`: the in-process engine's whole step (draft, verify, accept, the head's read) on the demo shape in
float32 with an EAGLE-3 head of its shape, both with random weights: milliseconds per target pass of greedy
decoding with a chain of K = 4 and with trees (the head's dynamic tree drafted as one captured graph), against
target-only. Random weights accept next to nothing: the figure is the step's cost, not a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ops.gpu_bench import time_fn
from pipeline.config import TreeConfig
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.models.shapes import SHAPES, random_llama
from pipeline.models.tree_attention import TreeMask, compact_indices
from pipeline.tree import tree_shape


def time_ms(fn) -> float:
    """Median milliseconds of fn() timed with CUDA events, calls back to back (`ops.gpu_bench.time_fn`)."""
    return time_fn(fn, iters=50, warmup=5)["median_ms"]


def bench_shape(shape: str, dtype: torch.dtype, nodes: list[int], branching: tuple[int, ...], context: int,
                chain_k: int) -> list[dict]:
    dev = torch.device("cuda")
    runner = random_llama(shape, dev, dtype, seed=0)
    graph = GraphCausalLM(runner, GraphConfig(batch_buckets=(1,)))
    graph.allocate(1, context + 64)
    for c in runner.k_caches + runner.v_caches:
        c.normal_()
    V = SHAPES[shape].vocab_size
    positions, slots = torch.tensor([context]), torch.tensor([0])
    rows = []
    for n in sorted(set(nodes) | {chain_k}):
        T = n + 1
        tokens = torch.randint(0, V, (1, T), device=dev)
        tree_nodes = tree_shape(TreeConfig(branching, max_nodes=n))
        parents = torch.tensor([[-1] + [p + 1 for p in tree_nodes.parents]], device=dev)
        tree = TreeMask(parents)
        row = {"model": shape, "dtype": str(dtype).removeprefix("torch."), "nodes": n, "T": T,
               "depth": tree_nodes.depth, "bucket": graph.shape_for(1, T, context)}
        for kind, kw in (("chain", {}), ("tree", {"tree": tree})):
            graph.forward(tokens, positions, slots, **kw)  # capture
            row[f"{kind}_step_ms"] = time_ms(lambda kw=kw: graph.forward(tokens, positions, slots, **kw))
            key = row["bucket"] if kind == "chain" else (*row["bucket"], "tree")
            entry = graph._graphs.get(key) if row["bucket"] is not None else None
            row[f"{kind}_replay_ms"] = (time_ms(entry.graph.replay) if entry is not None and entry.graph is not None
                                        else float("nan"))
        path = torch.arange(tree_nodes.depth, device=dev)[None, :]  # a move of `depth` entries (the first branch)
        src, dst = compact_indices(torch.tensor([context + 1], device=dev), path)
        graph.compact(slots, src, dst)  # capture
        row["compact_ms"] = time_ms(lambda: graph.compact(slots, src, dst))
        rows.append(row)
        print(f"{shape} T={T:2d} depth {row['depth']}: chain {row['chain_step_ms']:.3f} ms, tree "
              f"{row['tree_step_ms']:.3f} ms (replay {row['tree_replay_ms']:.3f}), compact {row['compact_ms']:.3f} ms",
              flush=True)
    base = next(r for r in rows if r["nodes"] == chain_k)["chain_step_ms"]
    for r in rows:
        r["tree_vs_chain_k"] = (r["tree_step_ms"] + r["compact_ms"]) / base
    graph = runner = None  # free the GPU memory before the next shape
    torch.cuda.empty_cache()
    return rows


def bench_engine(shape: str, trees: list[str], max_tokens: int, context: int, device: str = "cuda") -> list[dict]:
    """ms per target pass of the engine's greedy decoding (random weights: the cost of a step, module docstring)."""
    import tempfile

    from ops.bench_device_loop import random_head
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.tree_tune import parse_tree

    dev = torch.device(device)
    target = GraphCausalLM(random_llama(shape, dev, torch.float32, seed=0))
    folder = str(Path(tempfile.mkdtemp()) / "eagle3")
    random_head("eagle3", folder, target.runner)
    prompt = torch.randint(0, SHAPES[shape].vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for name in ["target-only", "chain"] + trees:
        tree = parse_tree(name) if name not in ("target-only", "chain") else None
        drafter = None if name == "target-only" else build_drafter(f"eagle3:{folder}", target.info, None,
                                                                   target=target.runner)
        engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_seq_len=context + 256,
                                                                      device=device, tree=tree))
        k = 0 if drafter is None else 4 if tree is None else len(tree.branching)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        engine.generate(prompt, params, SpecParams(k))  # captures
        sync()
        t0 = time.perf_counter()
        result = engine.generate(prompt, params, SpecParams(k))
        sync()
        passes = result.stats["target_passes"]
        rows.append({"model": shape, "drafter": name, "k": k, "passes": passes,
                     "ms_per_pass": (time.perf_counter() - t0) / passes * 1e3})
        print(f"engine {name}: {rows[-1]['ms_per_pass']:.2f} ms per target pass ({passes} passes)", flush=True)
        engine = drafter = None
    return rows


def table(rows: list[dict], chain_k: int, device: str) -> str:
    lines = [f"Token-tree verify on the captured path, batch 1 ({device}); x chain K={chain_k} = (tree step + compact) "
             f"/ the chain step of T={chain_k + 1}",
             "", "| model | dtype | nodes | T | depth | chain step ms | tree step ms | tree replay ms | compact ms | "
             f"x chain K={chain_k} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['nodes']} | {r['T']} | {r['depth']} | "
                     f"{r['chain_step_ms']:.3f} | {r['tree_step_ms']:.3f} | {r['tree_replay_ms']:.3f} | "
                     f"{r['compact_ms']:.3f} | {r['tree_vs_chain_k']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="smollm2-135m:float32,llama-8b:bfloat16", help="SHAPE:DTYPE,...")
    p.add_argument("--nodes", default="1,2,3,4,6,8,10,12,15,20,24,31",
                   help="tree sizes (nodes besides the pending token)")
    p.add_argument("--branching", default="4,3,2,2,1,1", help="the tree's children per depth (cut to each size)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("-k", type=int, default=4, help="the chain step compared with")
    p.add_argument("--part", choices=("verify", "engine"), default="verify")
    p.add_argument("--trees", default="dyn:4,4,4,4,4:16;dyn:6,6,6,6,6:24;3,2,2,1:8",
                   help="(engine part) trees as `pipeline.tree_tune.parse_tree` reads them, ';'-separated")
    p.add_argument("--device", default="cuda", help="(engine part) cpu: a dry run of the script")
    p.add_argument("--max-tokens", type=int, default=64, help="(engine part) tokens generated per run")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_tree_bench: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "engine":
        rows = bench_engine("smollm2-135m", args.trees.split(";"), args.max_tokens, args.context, args.device)
        lines = [f"Engine step on {device}, demo shape float32 + EAGLE-3 head, random weights (step cost only)", "",
                 "| drafter | K / depth | ms per target pass |", "|---|---|---|"]
        lines += [f"| {r['drafter']} | {r['k']} | {r['ms_per_pass']:.2f} |" for r in rows]
        (out / "gpu_tree_engine.json").write_text(json.dumps(rows, indent=1))
        print("\n".join(lines))
        return 0
    nodes = [int(n) for n in args.nodes.split(",")]
    branching = tuple(int(b) for b in args.branching.split(","))
    rows = []
    for spec in args.shapes.split(","):
        shape, _, dtype = spec.partition(":")
        shape_rows = bench_shape(shape, getattr(torch, dtype or "bfloat16"), nodes, branching, args.context, args.k)
        rows += shape_rows
        costs = {"device": device, "model": shape, "dtype": dtype, "context": args.context,
                 "date": time.strftime("%Y-%m-%d"),
                 "command": "python -m ops.gpu_tree_bench " + " ".join(argv or sys.argv[1:]),
                 "verify_s": {str(r["T"]): (r["tree_step_ms"] + r["compact_ms"]) / 1e3 for r in shape_rows},
                 "chain_verify_s": {str(r["T"]): r["chain_step_ms"] / 1e3 for r in shape_rows}}
        (out / f"tree_costs_{shape}.json").write_text(json.dumps(costs, indent=1))
    text = table(rows, args.k, device)
    (out / "gpu_tree_bench.md").write_text(text + "\n")
    (out / "gpu_tree_bench.json").write_text(json.dumps(rows, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
