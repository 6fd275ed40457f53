"""A target worker's pass, phase by phase, without Ray: what one verify call costs the worker of the Serve pipeline.

    python -m ops.bench_target_worker --shape smollm2-135m --dtype float32 --batch 1 --head eagle3   # on a GPU
    python -m ops.bench_target_worker --device cpu --shape tiny --passes 10                          # a dry run

A random-weight target of a named shape (`ops.gpu_serve_bench.write_random_target`; values change no cost) is
loaded by `deployments.target_replica.TargetWorker` as a replica loads it (its graphs captured by the worker's own
warm-up), with a random-weight feature head of the target's shape in the worker (`--head eagle3|medusa|none`).
`--batch` requests are admitted and prefilled; then each kind of pass runs `--passes` times after `--warmup`
untimed ones, every row in one pass (`TargetWorker._run_batch`, what the batcher calls):

- target only: a decode pass (no draft); with a head its states are still computed (the head reads every
  committed position);
- head drafts K: the worker's head drafts K tokens a row, the target verifies them.

Per kind: the pass's wall time, and a second run with each phase synchronised and timed (the target's forward,
the head's draft, the head's reading of the committed states, verification and acceptance, the rest): where the
time goes. `forward alone` is the target's captured forward of the same shape replayed back to back. Greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ops.gpu_serve_bench import random_prompts, write_random_target


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class PhaseTimer:
    """Wraps methods so each call is synchronised and timed under a phase name (patched back by `restore`)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._patched: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):  # inclusive: a phase inside another counts in both
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(self.device)
                self.seconds[phase] += time.perf_counter() - t0

        self._patched.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._patched):
            setattr(owner, attr, fn)
        self._patched.clear()


def run_passes(worker, rows: list, n: int, device: str) -> tuple[list[float], list]:
    """n passes of `rows` (each row's next call follows its verdict) -> seconds a pass, the rows' next calls."""
    from dataclasses import replace

    out = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        verdicts = worker._run_batch(rows)
        _sync(device)
        out.append(time.perf_counter() - t0)
        rows = [replace(r, start=r.start + len(v.tokens), pending=v.tokens[-1], step=r.step + 1, prefix=None)
                for r, v in zip(rows, verdicts)]
    return out, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--head", default="eagle3", choices=("eagle3", "medusa", "none"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--passes", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)

    from deployments.messages import VerifyCall
    from deployments.target_replica import TargetWorker
    from ops.bench_device_loop import _random_head
    from pipeline.config import SamplingParams
    from pipeline.models.loader import load_model
    from pipeline.step import Draft

    work = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    folder = write_random_target(args.shape, work / "target", args.device)
    head = None
    if args.head != "none":
        target, _ = load_model(str(folder), device="cpu", dtype="float32")
        _random_head(args.head, str(work / "head"), target)
        head = f"{args.head}:{work / 'head'}"
        del target
    t0 = time.perf_counter()
    worker = TargetWorker(str(folder), max_batch_size=args.batch, max_seq_len=args.prompt_len + 1024,
                          device=args.device, dtype=args.dtype, head=head)
    load_s = time.perf_counter() - t0
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"{card}: worker up in {load_s:.1f} s (graphs captured: {getattr(worker.model, 'stats', None)})", flush=True)
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=4096)
    prompts = random_prompts(args.batch, args.prompt_len, worker.model.info.vocab_size)
    rows = []
    for b, prompt in enumerate(prompts):
        rid = f"r{b}"
        asyncio.run(worker.admit(rid))
        rows.append(VerifyCall(rid, len(prompt) - 1, prompt[-1], Draft([]), greedy, 0, prefix=prompt[:-1]))
    while True:  # chunked prefill: rows come back AGAIN until their prompt is in
        results = worker._run_batch(rows)
        if all(not isinstance(r, str) for r in results):
            break
    rows = [VerifyCall(r.request_id, r.start + len(v.tokens), v.tokens[-1], Draft([]), greedy, 1)
            for r, v in zip(rows, results)]

    kinds = [("target only", 0)] + ([(f"head drafts K={args.k}", args.k)] if head else [])
    result: dict[str, Any] = {"card": card, "shape": args.shape, "dtype": args.dtype, "batch": args.batch,
                              "head": args.head, "k": args.k, "kinds": {},
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name, k in kinds:
        kind_rows = [VerifyCall(r.request_id, r.start, r.pending, Draft([]), greedy, r.step, head_draft=k,
                                draft_top_k=8) for r in rows]
        _, kind_rows = run_passes(worker, kind_rows, args.warmup, args.device)
        secs, kind_rows = run_passes(worker, kind_rows, args.passes, args.device)
        timer = PhaseTimer(args.device)
        timer.wrap(worker.model, "forward_features", "target forward")
        timer.wrap(worker.model, "forward", "target forward")
        if worker.head is not None:
            timer.wrap(worker.head, "propose", "head draft")
            timer.wrap(worker.head, "observe", "head reads states")
        import deployments.target_replica as tr

        timer.wrap(tr, "verify_and_accept", "verify+accept (incl. forward)")
        phased, kind_rows = run_passes(worker, kind_rows, args.passes, args.device)
        timer.restore()
        rows = [VerifyCall(r.request_id, r.start, r.pending, Draft([]), greedy, r.step) for r in kind_rows]
        phases = {ph: 1e3 * s / args.passes for ph, s in timer.seconds.items()}
        phases["pass (phases synchronised)"] = 1e3 * statistics.mean(phased)
        result["kinds"][name] = {"pass_ms_p50": 1e3 * statistics.median(secs),
                                 "pass_ms_mean": 1e3 * statistics.mean(secs), "phases_ms": phases}
        print(f"{name}: {result['kinds'][name]}", flush=True)
    lines = [f"{card}, {result['date']}: a target worker's pass without Ray, {args.shape} (random weights, "
             f"{args.dtype}), head {args.head} (random weights), batch {args.batch}, greedy, {args.passes} passes",
             "", "| pass | ms (p50) | phases, synchronised (ms a pass) |", "|---|---|---|"]
    for name, r in result["kinds"].items():
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
        lines.append(f"| {name} | {r['pass_ms_p50']:.2f} | {ph} |")
    md = "\n".join(lines) + "\n"
    print(md, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "target_worker.json").write_text(json.dumps(result, indent=1))
    (out / "target_worker.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
