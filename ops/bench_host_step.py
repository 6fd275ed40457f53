"""Host work a drafting step pays per row, growing with the context: reading the row's context, and a draft
model's catch-up (the common prefix of what it fed and what was committed).

    python -m ops.bench_host_step            # 2,000-token contexts, microseconds per row
    python -m ops.bench_host_step --tokens 512
"""

from __future__ import annotations

import argparse
import random
import sys

from ops.bench_hooks import per_call_us
from pipeline.drafters import _as_list, _common_prefix
from pipeline.sequence import TokenView


def element_loop(a: list[int], b: list[int]) -> int:
    """The common prefix computed one comparison a token, in Python (the baseline for `_common_prefix`)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000, help="context length (prompt + output)")
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    if args.tokens < 8:
        p.error("--tokens must be at least 8")
    g = random.Random(0)
    ctx = [g.randrange(50_000) for _ in range(args.tokens)]
    fed = ctx[:-3] + [1, 2, 3]  # what the draft model fed: the last step's drafts, rejected
    head, tail = ctx[: args.tokens * 3 // 4], ctx[args.tokens * 3 // 4:]  # prompt, output
    assert element_loop(fed, ctx) == _common_prefix(fed, ctx) == args.tokens - 3
    rows = [
        ("context: a copy (prompt + output)", lambda: head + tail),
        ("context: a view (TokenView)", lambda: TokenView(head, tail)),
        ("a draft model's list of the view", lambda: _as_list(TokenView(head, tail))),
        ("catch-up prefix: element loop", lambda: element_loop(fed, ctx)),
        ("catch-up prefix: _common_prefix", lambda: _common_prefix(fed, ctx)),
    ]
    print(f"| {args.tokens}-token context, per row | us |")
    print("|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, args.calls):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
