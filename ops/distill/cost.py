"""Drafter cost per token relative to the target, measured with the engine's runners on this machine.

    python -m ops.distill.cost --draft drafters/smollm2-135m-distill [--threads 2] [--context 256]

Times one decoding forward (1 token at position `context`) of the target and of the drafter, and the
target's verification forward over K+1 tokens, interleaved (target, drafter, target, ...) so that machine
noise hits both alike; reports medians and the ratios, plus the parameter-count ratio of the matrix products.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pipeline.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target, _ = load_model(args.target)
    draft, _ = load_model(args.draft)
    for m in (target, draft):
        m.allocate(1, args.context + 64)
        m.forward(torch.randint(0, 8000, (1, args.context)), torch.zeros(1, dtype=torch.long),
                  torch.zeros(1, dtype=torch.long))
    slot = torch.zeros(1, dtype=torch.long)
    pos = torch.tensor([args.context])

    def timed(m, t: int) -> float:
        x = torch.randint(0, 8000, (1, t))
        t0 = time.perf_counter()
        m.forward(x, pos, slot)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"target_1": [], "draft_1": [], "target_verify": []}
    for _ in range(5):  # warm-up
        timed(target, 1), timed(draft, 1), timed(target, args.k + 1)
    for _ in range(args.repeats):
        times["target_1"].append(timed(target, 1))
        times["draft_1"].append(timed(draft, 1))
        times["target_verify"].append(timed(target, args.k + 1))
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}

    def matmul_params(runner) -> int:
        mdl = runner.model
        layers = sum(p.numel() for p in mdl.layers.parameters() if p.dim() == 2)
        return layers + mdl.output.weight.numel()

    out = {
        "threads": args.threads, "context": args.context, "k": args.k,
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "draft_over_target_per_token": round(med["draft_1"] / med["target_1"], 4),
        "verify_over_target_decode": round(med["target_verify"] / med["target_1"], 4),
        "draft_over_target_matmul_params": round(matmul_params(draft) / matmul_params(target), 4),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
