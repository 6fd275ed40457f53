"""`specserve generate`: speculative decoding in this process, streaming text as it is accepted.

torch and pipeline/ are imported inside `run`, not at the top: `specserve --help` does not need them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--target", default=None,
                   help="target model folder or .gguf (default: the demo SmolLM2-135M-Instruct)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", default=None,
                   help="drafter: a model folder, 'prompt-lookup', 'suffix' (suffix decoding), 'medusa:DIR' or "
                        "'eagle3:DIR' (feature heads on the target's hidden states), 'lookup+MODEL' "
                        "(prompt lookup where the context matches, the model elsewhere), "
                        "or 'default' (the project's default drafter)")
    g.add_argument("--no-draft", action="store_true", help="plain target decoding, no speculation")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4, help="K, tokens drafted per target pass")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reported back when omitted)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--draft-weights", default="model", choices=("model", "fp8"),
                   help="fp8: the draft model's CUDA graph path streams float8 copies of its weights (half the bytes; "
                        "acceptance may move, the output cannot). Needs --device cuda and a bf16/fp16 draft model")
    add_tree_arguments(p)
    p.add_argument("--fixed-k", action="store_true",
                   help="draft K tokens every step (default: greedy requests adapt K per step between 0 and K "
                        "from measured step costs and acceptance; sampled requests always use K)")


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    """--tree and --tree-nodes (`specserve generate` and `specserve bench`)."""
    p.add_argument("--tree", default=None, metavar="B1,B2,...|FILE.json",
                   help="draft a token tree instead of a chain: children per node at each depth (e.g. 3,2,1), or a "
                        "tree file of `specserve tune-tree`; needs a draft model or a feature head ('eagle3:DIR', "
                        "'medusa:DIR'; a 'lookup+WORD' drafter drafts with its WORD); -k caps the depth")
    p.add_argument("--tree-nodes", type=int, default=None, help="node budget of --tree (default: the full tree)")
    p.add_argument("--tree-dynamic", action="store_true", help="EAGLE-2's dynamic tree (an EAGLE-3 head, greedy): "
                   "--tree's counts are nodes kept to grow on and children each, per depth; needs --tree-nodes")


def tree_config(args: argparse.Namespace):  # -> pipeline.config.TreeConfig | None
    """The `TreeConfig` of --tree and --tree-nodes, or None (chains)."""
    from pipeline.config import TreeConfig
    from pipeline.tree_tune import load_tree

    if args.tree is None:
        if args.tree_nodes is not None or args.tree_dynamic:
            raise ValueError("--tree-nodes and --tree-dynamic need --tree")
        return None
    if not args.tree.replace(",", "").strip().isdigit():  # a tree file
        if args.tree_nodes is not None or args.tree_dynamic:
            raise ValueError(f"a tree file ({args.tree}) is a static shape of its own: it takes no --tree-nodes or "
                             "--tree-dynamic")
        return load_tree(args.tree)
    try:
        branching = tuple(int(b) for b in args.tree.split(","))
    except ValueError:
        raise ValueError(f"--tree takes children per depth as a comma list (e.g. 3,2,1), got {args.tree!r}")
    return TreeConfig(branching, args.tree_nodes, dynamic=args.tree_dynamic)


def tree_draft(tree, draft: str | None, serve: bool = False) -> str | None:
    """The drafter word a tree drafts with: a 'lookup+MODEL' drafter's MODEL (said on stderr). In process a feature
    head behind prompt lookup keeps it (the looked-up rows draft chains, the others the head's trees); Serve's
    trees are drafted by the head alone."""
    from pipeline.config import HYBRID_PREFIX, is_head

    keep = is_head(draft) and not serve
    if tree is not None and draft is not None and draft.startswith(HYBRID_PREFIX) and not keep:
        draft = draft[len(HYBRID_PREFIX):]
        sys.stderr.write(f"[token tree: drafting with {draft}, without prompt lookup]\n")
    return draft


def run(args: argparse.Namespace) -> int:
    # Validate the cheap things before loading anything.
    from pipeline.config import EngineConfig, SamplingParams, SpecParams

    if args.num_draft_tokens < 1:
        raise ValueError(f"-k must be >= 1, got {args.num_draft_tokens} (use --no-draft to turn speculation off)")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=tuple(args.stop),
    ).with_seed()
    spec = SpecParams(num_draft_tokens=args.num_draft_tokens)
    tree = tree_config(args)

    import torch

    from pipeline.engine import SpeculativeEngine, default_draft
    from pipeline.models.loader import runner_choice

    torch.set_num_threads(max(1, torch.get_num_threads()))
    draft = None if args.no_draft else (default_draft(args.target) if args.draft in (None, "default") else args.draft)
    draft = tree_draft(tree, draft)
    config = EngineConfig(max_batch_size=1, max_seq_len=args.max_seq_len, device=args.device, dtype=args.dtype,
                          draft_weights=args.draft_weights, tree=tree)
    engine = SpeculativeEngine.from_pretrained(args.target, draft, config, adaptive_k=not args.fixed_k)
    sys.stderr.write(f"[target {runner_choice(args.target, args.device)}]\n")  # which runner, and why

    result = None
    for event in engine.stream(args.prompt, params, spec, chat=args.chat):
        if not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        result = event.result or result
    assert result is not None
    if args.json:
        json.dump(_as_json(result, draft), sys.stdout)
        sys.stdout.write("\n")
    else:
        s = result.stats
        sys.stdout.write("\n")
        sys.stderr.write(
            f"[{s['generated']} tokens in {s['wall_time_s']:.2f} s, {s['tokens_per_s']:.1f} tok/s, "
            f"{s['mean_accepted_tokens']:.2f} tokens/pass, acceptance {s['acceptance_rate']:.2f}, "
            f"drafter {draft or 'none'}, seed {result.seed}, finish {result.finish_reason}]\n"
        )
    return 0


def _as_json(result: Any, draft: str | None) -> dict[str, Any]:
    return {
        "token_ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "seed": result.seed,
        "drafter": draft,
        "stats": result.stats,
    }


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text with speculative decoding (in-process)",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)
