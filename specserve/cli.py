"""`specserve` entry point: each subcommand lives in a specserve/cmd_*.py module that exposes
`register(subparsers)` and keeps its heavy imports (torch, Ray) inside its handler, so that `specserve --help`
stays fast.

Every handler returns an exit code. Bad input ends with one clear line on stderr and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from deployments.ray_env import apply_ray_defaults
from specserve import (
    cmd_bench,
    cmd_bench_serve,
    cmd_chaos,
    cmd_distill,
    cmd_generate,
    cmd_load,
    cmd_otlp_receiver,
    cmd_serve,
    cmd_tune_tree,
)

SUBCOMMANDS = (cmd_generate, cmd_serve, cmd_bench, cmd_bench_serve, cmd_distill, cmd_load, cmd_otlp_receiver,
               cmd_chaos, cmd_tune_tree)
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ConnectionError, TimeoutError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Exact speculative decoding, served on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    apply_ray_defaults()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"specserve {args.command}: error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
