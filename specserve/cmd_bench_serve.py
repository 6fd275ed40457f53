"""`specserve bench-serve`: the full HTTP pipeline (Ray Serve on a local Ray) against the in-process engine,
same prompts, same run; see specserve/serve_bench.py. Writes serve_bench.json and serve_bench.md to --out.

    specserve bench-serve                                   # demo pair, the shipped Spec-Bench prompts, greedy
    specserve bench-serve --threads 2 --concurrency 1,4,16 --out bench-serve
"""

from __future__ import annotations

import argparse
from typing import Any

from specserve.cmd_generate import add_tree_arguments
from specserve.prompts import SPEC_BENCH_DEV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=str(SPEC_BENCH_DEV),
                   help="Spec-Bench jsonl (default: the shipped Spec-Bench dev set, %(default)s)")
    p.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads: engine here and the target worker")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--repeats", type=int, default=2, help="engine/HTTP pairs per prompt (one stream)")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--prespec-branches", type=int, default=None,
                   help="coordinator.prespec_branches: outcomes pre-speculated a step (default: the config's)")
    p.add_argument("--fixed-k", action="store_true", help="K every step, in the engine and the coordinator alike")
    p.add_argument("--draft", default=None,
                   help="'prompt-lookup', a drafter model folder, 'lookup+MODEL', or a feature head 'eagle3:DIR' / "
                        "'medusa:DIR' (default: the demo target's default drafter, as `specserve serve` deploys it)")
    p.add_argument("--head-placement", choices=("target", "drafter"), default="target",
                   help="with a feature head: drafter.head_placement (in the target workers, or on drafter replicas)")
    add_tree_arguments(p)  # drafter.tree in the app, EngineConfig.tree in the engine
    p.add_argument("--api-key", default=None,
                   help="the deployed app takes this key and the clients send it (default: the first key of "
                        "$SPECSERVE_API_KEY; unset: no key)")
    p.add_argument("--out", default="bench-serve")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: Ray, Serve and torch are not needed for `specserve --help`.
    from specserve.serve_bench import run as run_serve_bench

    run_serve_bench(args)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench-serve", help="HTTP pipeline (Ray Serve) vs the in-process engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
