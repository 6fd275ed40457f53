"""`specserve tune-tree`: the best static token tree for a drafter, a target and this machine (Sequoia; the model
and the optimiser are `pipeline.tree_tune`).

    specserve tune-tree --prompts prompts.jsonl --out trees/eagle3-cpu.json   # the demo target, its EAGLE-3 head
    specserve tune-tree --acceptance trees/eagle3-cpu.json --costs h200.json --out trees/eagle3-h200.json
    specserve generate --draft eagle3:smollm2-135m-eagle3 --tree trees/eagle3-cpu.json -k 6 --prompt ...

1. Acceptance by depth and rank: the engine decodes distillation prompts greedily (`--prompts`, a file of
   `python -m ops.distill.build_prompts` in a checkout; never the Spec-Bench evaluation set) drafting a wide
   measurement tree (`measurement_tree`: `--ranks` candidates under each rank-0 node to `--max-depth`, filled to
   `--measure-nodes` nodes), and each pass's accepted path gives, at each depth, which ranks were drafted and which
   one held the target's token. Or `--acceptance FILE` (a tree file, or {"rank_acceptance": [[...], ...]}).
2. Costs on this machine: the target's verify pass over n + 1 tokens with the tree mask for n = 1..--max-nodes, at
   a `--context`-token context (the least of `--reps` interleaved passes: load on a shared machine only adds; the
   table is kept as measured, since a pass over more tokens can cost less where the kernels change), and one draft
   level (the drafter's chain step over K = --max-depth, per token). Or `--costs FILE`:
   {"device": ..., "verify_s": {"2": s, "3": s, ...}, "draft_level_s": s}.
3. The best tree per node budget and depth, the one of most predicted tokens/s, written to `--out` (with a plot of
   predicted tokens per pass against the budget beside it when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_HEAD = "eagle3:smollm2-135m-eagle3"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=DEFAULT_HEAD,
                   help="a drafter that drafts trees: a draft model, 'eagle3:DIR' or 'medusa:DIR' "
                        "(default %(default)s)")
    p.add_argument("--out", default="tuned-tree.json", help="the tree file to write (default %(default)s)")
    p.add_argument("--max-nodes", type=int, default=32, help="largest node budget considered (1-64)")
    p.add_argument("--max-depth", type=int, default=6, help="deepest tree considered (and measured)")
    p.add_argument("--acceptance", default=None, help="read the acceptance by depth and rank from this JSON file")
    p.add_argument("--costs", default=None, help="read the cost table from this JSON file (e.g. measured on a GPU)")
    p.add_argument("--prompts", default=None,
                   help="distillation prompts: .jsonl(.gz) chats or .npz token ids "
                        "(python -m ops.distill.build_prompts)")
    p.add_argument("--num-prompts", type=int, default=24, help="prompts decoded to measure acceptance")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--ranks", type=int, default=8, help="candidates per node measured (the measurement tree's width)")
    p.add_argument("--measure-nodes", type=int, default=48,
                   help="nodes of the measurement tree (up to 64): --ranks children of every rank-0 node, then the "
                        "nodes whose ranks add up least")
    p.add_argument("--context", type=int, default=512, help="context length of the verify-cost passes")
    p.add_argument("--reps", type=int, default=5, help="timed passes per size (their median is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pipeline.config import MAX_TREE_NODES
    from pipeline.tree_tune import best_trees, choose, load_costs, load_rank_acceptance, save_tree

    if not 1 <= args.max_nodes <= MAX_TREE_NODES or args.max_depth < 1 or args.ranks < 1:
        raise ValueError(f"--max-nodes must be in [1, {MAX_TREE_NODES}], --max-depth and --ranks >= 1; got "
                         f"{args.max_nodes}, {args.max_depth}, {args.ranks}")
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be >= 1")
    accept = load_rank_acceptance(args.acceptance) if args.acceptance else None
    costs = load_costs(args.costs) if args.costs else None
    if accept is None and not args.prompts:
        raise ValueError("measuring acceptance needs --prompts FILE (distillation prompts: python -m "
                         "ops.distill.build_prompts in a checkout) or --acceptance FILE")
    about: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "draft": args.draft,
                             "target": args.target or "demo", "acceptance_from": args.acceptance,
                             "costs_from": args.costs}
    if accept is None or costs is None:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        engine = _engine(args)
        if accept is None:
            prompts, source = _prompts(args, engine.tokenizer)
            about.update(prompts=source, num_prompts=len(prompts), max_tokens=args.max_tokens, ranks=args.ranks,
                         measure_nodes=args.measure_nodes)
            accept = measure_acceptance(engine, prompts, args)
        if costs is None:
            costs = measure_costs(engine, args)
            about.update(context=args.context, reps=args.reps)
    trees = best_trees(accept, args.max_nodes, args.max_depth)
    best, rows = choose(trees, costs)
    print("acceptance by depth (rank 0, 1, ..): " + "; ".join(
        " ".join(f"{a:.2f}" for a in row[:4]) + (" .." if len(row) > 4 else "") for row in accept))
    print(f"costs ({costs.device}): verify T=2 {costs.verify_s.get(2, float('nan')) * 1e3:.1f} ms, "
          f"draft level {costs.draft_level_s * 1e3:.1f} ms\n")
    print("| nodes | depth | E[tokens/pass] | step ms | tokens/s |\n|---|---|---|---|---|")
    for c in rows:
        mark = " **chosen**" if c is best else ""
        print(f"| {c.tree.num_nodes} | {c.tree.depth} | {c.tokens_per_pass:.3f} | {c.step_s * 1e3:.1f} | "
              f"{c.tokens_per_s:.1f}{mark} |")
    save_tree(args.out, best, rows, accept, costs, about)
    print(f"\nchosen: {best.tree.num_nodes} nodes, depth {best.tree.depth}, {best.tokens_per_pass:.2f} tokens/pass, "
          f"{best.tokens_per_s:.1f} tokens/s predicted -> {args.out} (run it with -k {best.tree.depth} or more)")
    _plot(rows, best, Path(args.out).with_suffix(".png"))
    return 0


def _engine(args: argparse.Namespace):
    from pipeline.config import EngineConfig
    from pipeline.engine import SpeculativeEngine

    # the default path: on CUDA the captured graphs, where trees of up to 31 nodes verify (larger ones run eagerly)
    return SpeculativeEngine.from_pretrained(args.target, args.draft, EngineConfig(
        max_batch_size=1, max_seq_len=4096, device=args.device, dtype=args.dtype), adaptive_k=False)


def _prompts(args: argparse.Namespace, tokenizer) -> tuple[list[list[int]], str]:
    """Token ids of the measurement prompts (`--prompts`), and where they came from."""
    from pipeline.distill.prompts import load_prompts
    from specserve.prompts import SPEC_BENCH_DEV

    path = Path(args.prompts)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.resolve() == SPEC_BENCH_DEV.resolve() or "spec_bench" in path.name:
        raise ValueError(f"{path} is the evaluation set: tune on distillation prompts, never on it")
    prompts = load_prompts(path, tokenizer)[: args.num_prompts]
    return [p.ids for p in prompts], str(path)


def measurement_tree(ranks: int, depth: int, nodes: int):  # -> TreeConfig
    """The tree drafted to measure acceptance: every rank-0 path's node gets `ranks` children (each depth sees every
    rank drafted), and the nodes whose ranks add up least fill it up to `nodes` (the caterpillar alone if larger)."""
    from pipeline.config import MAX_TREE_NODES, TreeConfig
    from pipeline.tree import tree_shape

    spine = {(0,) * d + (r,) for d in range(depth) for r in range(ranks)}
    if len(spine) > MAX_TREE_NODES:
        raise ValueError(f"--ranks x --max-depth must be at most {MAX_TREE_NODES}, got {ranks} x {depth}")
    full = tree_shape(TreeConfig((ranks,) * depth, max_nodes=min(MAX_TREE_NODES, max(nodes, 1))))
    paths: list[tuple[int, ...]] = [()] * full.num_nodes
    for i, (p, r) in enumerate(zip(full.parents, full.ranks)):
        paths[i] = (paths[p] if p >= 0 else ()) + (r,)
    for p in sorted(paths, key=lambda p: (sum(p), len(p), p)):  # a parent and a left sibling sort first
        if len(spine) >= nodes:
            break
        spine.add(p)
    return TreeConfig(paths=tuple(spine))


def measure_acceptance(engine, prompts: list[list[int]], args: argparse.Namespace) -> list[list[float]]:
    """Greedy decoding of `prompts` drafting a measurement tree; the accepted paths' ranks (`RankCounter`)."""
    import dataclasses

    from tqdm import tqdm

    from pipeline.config import SamplingParams, SpecParams
    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.tree_tune import RankCounter

    tree = measurement_tree(args.ranks, args.max_depth, args.measure_nodes)
    drafter = build_drafter(args.draft, engine.target.info, engine.tokenizer, args.device, target=engine.target)
    eng = SpeculativeEngine(engine.target, engine.tokenizer, drafter, dataclasses.replace(engine.config, tree=tree))
    passes: dict[str, list[tuple[int, list[int], list[int]]]] = {}  # request -> (context length, parents, tokens)
    propose = eng.drafter.propose

    def recording(rows, *a, **kw):
        block = propose(rows, *a, **kw)
        num, tokens = block.num_draft.tolist(), block.token_ids.tolist()
        parents = block.parents.tolist() if block.parents is not None else [list(range(-1, block.k - 1))] * len(rows)
        for b, r in enumerate(rows):
            passes.setdefault(r.request_id, []).append((len(r.context), parents[b][: num[b]], tokens[b][: num[b]]))
        return block

    eng.drafter.propose = recording
    counter = RankCounter(args.max_depth, args.ranks)
    params = SamplingParams(max_tokens=args.max_tokens, seed=0)
    for ids in tqdm(prompts, desc="acceptance", unit="prompt", disable=args.no_progress):
        result = eng.generate(ids, params, SpecParams(args.max_depth))
        full = list(ids) + result.token_ids
        for length, parents, tokens in passes.pop(result.request_id, []):
            counter.observe(parents, tokens, full[length:])
    return counter.rank_acceptance()


def measure_costs(engine, args: argparse.Namespace):
    """This machine's cost table: verify passes of n + 1 tokens with a tree mask (the least of --reps), and one
    draft level (a chain step of the drafter over K = --max-depth, per drafted token, on two prompts of token ids)."""
    from pipeline.config import SamplingParams, SpecParams
    from pipeline.tree import TreeShape
    from pipeline.tree_tune import Costs, verify_seconds
    from specserve.spec_bench import machine

    seconds = [0.0, 0]  # drafting seconds, tokens drafted
    propose = engine.drafter.propose

    def timed(rows, *a, **kw):
        t0 = time.perf_counter()
        block = propose(rows, *a, **kw)
        block.num_draft.tolist()  # the drafting is done (a device sync)
        seconds[0] += time.perf_counter() - t0
        seconds[1] += max(r.num_draft for r in rows)
        return block

    engine.drafter.propose = timed
    for i in range(2):  # token ids: no tokenizer needed (a random-weight target of a shape times the same)
        prompt = [100 + (37 * j + 11 * i) % 900 for j in range(64)]
        engine.generate(prompt, SamplingParams(max_tokens=32, seed=0, ignore_eos=True), SpecParams(args.max_depth))
    engine.drafter.propose = propose
    shapes = {str(n + 1): TreeShape.chain(n) for n in range(1, args.max_nodes + 1)}
    verify = verify_seconds(engine.target, shapes, args.context, args.reps, reduce=min)
    return Costs(machine(), {int(t): s for t, s in verify.items()}, seconds[0] / max(1, seconds[1]))


def _plot(rows, best, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([c.tree.num_nodes for c in rows], [c.tokens_per_pass for c in rows], marker=".", label="tokens/pass")
    ax.set_xlabel("node budget")
    ax.set_ylabel("predicted tokens per pass")
    ax2 = ax.twinx()
    ax2.plot([c.tree.num_nodes for c in rows], [c.tokens_per_s for c in rows], color="tab:orange", marker=".")
    ax2.set_ylabel("predicted tokens/s", color="tab:orange")
    ax.axvline(best.tree.num_nodes, color="grey", linestyle=":")
    ax.set_title("best tree per node budget")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    sys.stderr.write(f"[plot -> {path}]\n")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("tune-tree", help="the best static token tree for a drafter on this machine (Sequoia)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
