"""`specserve load`: drive N concurrent streaming clients against the HTTP API (see specserve/loadgen.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specserve.prompts import SPEC_BENCH_DEV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("-c", "--concurrency", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("-n", "--num-requests", type=int, default=32, help="total requests (upper bound)")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=None, help="K per request (server default)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--prompts", default=None,
                   help="a .jsonl (Spec-Bench 'turns', or 'prompt'/'text') or a text file, one prompt a line "
                        f"(default: eight built-in prompts; the Spec-Bench dev set ships as {SPEC_BENCH_DEV})")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: the first key of "
                                                   "$SPECSERVE_API_KEY, if set)")
    p.add_argument("-o", "--out", default="load-out", help="folder for summary.json, requests.jsonl, PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: httpx is not needed for `specserve --help`.
    from pipeline import envs
    from specserve.loadgen import LoadConfig, load_prompts
    from specserve.loadgen import run as run_load

    api_key = args.api_key or next(iter(envs.SPECSERVE_API_KEY), None)

    config = LoadConfig(
        url=args.url.rstrip("/"), model=args.model, concurrency=args.concurrency,
        num_requests=args.num_requests, duration_s=args.duration, max_tokens=args.max_tokens,
        temperature=args.temperature, num_draft_tokens=args.num_draft_tokens, endpoint=args.endpoint,
        ignore_eos=args.ignore_eos, seed=args.seed, timeout_s=args.timeout, api_key=api_key,
    )
    summary = run_load(config, load_prompts(args.prompts), args.out, progress=not args.no_progress,
                       plots=not args.no_plots)
    json.dump(_brief(summary), sys.stdout, indent=2)
    print()
    return 0 if summary["requests"]["ok"] > 0 else 1


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    """What is printed: the summary without the echo of the config."""
    return {k: v for k, v in summary.items() if k != "config"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("load", help="load-test a running server with concurrent streaming clients",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve load", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
