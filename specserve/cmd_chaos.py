"""`specserve chaos`: a fault campaign. Starts a local Ray and Serve, runs a seeded request set once without
faults, then once per fault (a drafter, a target, one rank of a TP=2 target, a coordinator, the embedded Redis, an
external Redis with AOF, the HTTP proxy: each SIGKILLed mid-load) and prints one table: requests completed,
resumed with Last-Event-ID, lost or duplicated tokens, outputs differing from the fault-free run, time to recover.
See specserve/chaos.py.

    specserve chaos                                  # every fault, 16 streams, the demo pair
    specserve chaos --faults target,redis -c 6 -n 6 --max-tokens 24
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

FAULTS = "drafter,target,coordinator,redis,proxy,tp-rank,redis-aof"  # specserve.chaos.FAULTS (not imported here)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", default=FAULTS,
                   help="comma-separated, in this order of setups: %(default)s")
    p.add_argument("--target", default=None, help="target model folder (default: the demo model)")
    p.add_argument("--draft", default=None, help="drafter word (default: as `specserve serve`)")
    p.add_argument("-c", "--concurrency", type=int, default=16, help="streams at once")
    p.add_argument("-n", "--num-requests", type=int, default=32, help="requests per run (closed loop)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled half of the requests")
    p.add_argument("-k", "--num-draft-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--trigger", type=float, default=0.25, help="kill when this share of the tokens has streamed")
    p.add_argument("-o", "--out", default="load-out/chaos", help="folder for chaos.json and chaos.md")


def run(args: argparse.Namespace) -> int:
    from specserve.chaos import COLUMNS, ChaosConfig, markdown_table, run_campaign

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    config = ChaosConfig(target=args.target, draft=args.draft, faults=faults, concurrency=args.concurrency,
                         num_requests=args.num_requests, max_tokens=args.max_tokens, temperature=args.temperature,
                         num_draft_tokens=args.num_draft_tokens, seed=args.seed, max_seq_len=args.max_seq_len,
                         trigger=args.trigger)
    rows = run_campaign(config, args.out, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown_table(rows))
    for row in rows:
        if not row["ok"]:
            print(json.dumps({c: row[c] for c in ("fault", "mismatched_requests", "errors")}))
    print(f"written: {args.out}/chaos.json, {args.out}/chaos.md; columns: {', '.join(COLUMNS)}", file=sys.stderr)
    return 0 if all(row["ok"] for row in rows) else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("chaos", help="kill each part of the stack under load; check nothing is lost",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
