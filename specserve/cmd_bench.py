"""`specserve bench`: Spec-Bench prompts through this engine and Hugging Face, side by side (greedy); see
specserve/spec_bench.py. The prompts default to the Spec-Bench dev set shipped with specserve.

The GPU step and kernel benchmarks are developer scripts, run from a checkout of the repository:
`python -m ops.gpu_bench --help` (and the other ops/*_bench.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specserve.cmd_generate import add_tree_arguments, tree_config, tree_draft
from specserve.prompts import SPEC_BENCH_DEV, load_prompts

METHODS = "engine-target,engine-spec,hf-generate,hf-assisted"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model (default: the demo model)")
    p.add_argument("--draft", default="default",
                   help="drafter: model folder, 'prompt-lookup', 'suffix', 'lookup+MODEL' or 'default'")
    p.add_argument("--prompts", default=str(SPEC_BENCH_DEV),
                   help="Spec-Bench jsonl (default: the shipped Spec-Bench dev set, %(default)s)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per Spec-Bench category")
    p.add_argument("--methods", default=METHODS, help="comma-separated subset of %(default)s")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weights and activations of every method (engine and Hugging Face alike)")
    p.add_argument("--draft-weights", default="model", choices=("model", "fp8"),
                   help="fp8: the draft model's CUDA graph path streams float8 copies of its weights (half the bytes; "
                        "acceptance may move, the output cannot). Needs --device cuda and a bf16/fp16 draft model")
    p.add_argument("--fixed-k", action="store_true",
                   help="engine-spec drafts K tokens every step (default: K adapts per step between 0 and K "
                        "from measured step costs and acceptance, as in `specserve generate`)")
    add_tree_arguments(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("-o", "--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.num_draft_tokens < 1:
        raise ValueError(f"-k must be >= 1, got {args.num_draft_tokens}")
    tree = tree_config(args)
    # Imported here, not at the top: torch and the models are not needed for `specserve --help`.
    import torch

    from pipeline.engine import default_draft
    from specserve.spec_bench import markdown_table, plot, run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.per_category)
    draft = tree_draft(tree, default_draft(args.target) if args.draft == "default" else args.draft)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    result = run_bench(args.target, draft, prompts, methods, args.num_draft_tokens, args.max_tokens,
                       device=args.device, progress=not args.no_progress, dtype=args.dtype,
                       adaptive_k=not args.fixed_k, draft_weights=args.draft_weights, tree=tree)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(result)
    (out / "bench.md").write_text(table)
    try:
        plot(result, out / "bench.png")
    except ImportError:
        pass
    sys.stdout.write(table)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="Spec-Bench throughput: engine vs Hugging Face", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
