"""Where one engine step's time goes, phase by phase, at a batch size and a K (host overhead included).

    python -m ops.profile_step --shape smollm2-135m --dtype float32 --batch 32 --ks 0,1,2,4

A random-weight target of a named shape (`pipeline.models.shapes`; values do not change a step's cost) runs
`SpeculativeEngine.step` at a fixed K (K = 0: no drafter), `--steps` timed steps after a warm-up. The drafter
is `--drafter repeat` (default: every row drafts K copies of its last token, so every verify feeds exactly K+1
tokens and its cost is measured at that shape) or `lookup` (prompt lookup: its real host cost, but it drafts only
where it finds a match). Each phase is timed on the host by wrapping the function that does it (no sync is added):

- sampling: per-row sampling tensors; propose: the drafter; target: launching the target pass (a graph replay
  on CUDA; the whole forward on CPU); verify / accept: the rejection-sampling ops (launches);
- rest: everything else in the step, which on CUDA is mostly waiting in the step's one host sync for the GPU,
  then committing tokens.

`forward alone` is the target pass at the step's most common shape, replayed back to back with a sync at the
end: what the step would cost with no host work at all. Prompts are random tokens built of a repeated chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

PHASES = ("sampling", "propose", "target", "verify", "accept")


def _timed(name: str, fn: Callable, acc: dict[str, float]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0

    return wrapper


class RepeatDrafter:
    """Drafts K copies of each row's last token: a fixed verify shape for timing (acceptance is meaningless)."""

    name = "repeat"

    def propose(self, rows, k, sampling, steps, draft_top_k):
        from pipeline.rejection import DraftBlock

        last = torch.tensor([r.context[-1] for r in rows], dtype=torch.int64)
        return DraftBlock(last[:, None].expand(len(rows), k).clone(),
                          torch.tensor([r.num_draft for r in rows], dtype=torch.int64))

    def admit(self, request_id, context) -> None:
        pass

    def release(self, request_id) -> None:
        pass


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        chunk = torch.randint(100, vocab, (48,), generator=gen).tolist()
        out.append((chunk * (length // len(chunk) + 1))[:length])
    return out


def profile(args: argparse.Namespace) -> dict:
    import pipeline.engine as engine_mod
    import pipeline.step as step_mod  # the step's verify and accept are looked up there at call time
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import PromptLookupDrafter
    from pipeline.models.shapes import SHAPES, random_llama
    from pipeline.sampling import SamplingTensors

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    model = random_llama(shape, device, dtype)
    ks = [int(k) for k in args.ks.split(",")]
    need = args.prompt_len + (args.warmup + args.steps) * (max(ks) + 1) + 8
    config = EngineConfig(max_batch_size=args.batch, max_seq_len=need, device=str(device), dtype=args.dtype)
    engine = engine_mod.SpeculativeEngine(model, None, None, config)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    acc: dict[str, float] = defaultdict(float)
    real = {"verify": step_mod.verify, "accept": step_mod.accept, "target": engine.target.forward,
            "sampling": SamplingTensors.from_params}
    step_mod.verify = _timed("verify", real["verify"], acc)
    step_mod.accept = _timed("accept", real["accept"], acc)
    SamplingTensors.from_params = staticmethod(_timed("sampling", real["sampling"], acc))
    shapes: Counter = Counter()
    fwd = real["target"]

    def record_shape(tokens, positions, slots, logits_from=0):
        shapes[tuple(tokens.shape)] += 1
        return fwd(tokens, positions, slots, logits_from)

    engine.target.forward = _timed("target", record_shape, acc)
    rows = []
    try:
        for k in ks:
            drafter = None if k == 0 else PromptLookupDrafter() if args.drafter == "lookup" else RepeatDrafter()
            if drafter is not None:
                drafter.propose = _timed("propose", drafter.propose, acc)
            engine.drafter = drafter
            states = engine._make_states(_prompts(args.batch, args.prompt_len, shape.vocab_size, k),
                                         SamplingParams(max_tokens=need - args.prompt_len - 1, seed=0, ignore_eos=True),
                                         chat=False)
            slots = list(range(args.batch))
            for s, slot in zip(states, slots):
                engine._prefill(s, slot)
            spec = SpecParams(num_draft_tokens=max(k, 1))
            for _ in range(args.warmup):
                engine.step(states, slots, spec)
            sync()
            acc.clear()
            shapes.clear()
            times = []
            tokens0 = sum(len(s.output_ids) for s in states)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step(states, slots, spec)
                times.append(time.perf_counter() - t0)
            sync()
            emitted = sum(len(s.output_ids) for s in states) - tokens0
            common = shapes.most_common(1)[0][0]
            alone = _forward_alone(fwd, common, states, slots, args.iters, sync, device)
            n = args.steps
            per = {p: 1e3 * acc.get(p, 0.0) / n for p in PHASES}
            step_ms = 1e3 * statistics.mean(times)
            row = {"k": k, "step_ms": step_ms, "step_ms_median": 1e3 * statistics.median(times),
                   "mean_T": sum(t * c for (_, t), c in shapes.items()) / max(sum(shapes.values()), 1),
                   "tokens_per_step_per_row": emitted / (n * args.batch), "common_shape": list(common),
                   "forward_alone_ms": alone, **{f"{p}_ms": v for p, v in per.items()},
                   "rest_ms": step_ms - sum(per.values())}
            rows.append(row)
            print(_line(row), flush=True)
            for s, slot in zip(states, slots):
                engine._retire(s, slot)
    finally:
        step_mod.verify, step_mod.accept = real["verify"], real["accept"]
        SamplingTensors.from_params = staticmethod(real["sampling"])
    return {"shape": args.shape, "dtype": args.dtype, "drafter": args.drafter, "batch": args.batch,
            "prompt_len": args.prompt_len,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "rows": rows}


@torch.inference_mode()
def _forward_alone(fwd: Callable, shape: tuple[int, int], states, slots, iters: int, sync, device) -> float:
    """ms per target pass of this shape replayed back to back (its own writes land past the rows' tokens)."""
    B, T = shape
    tokens = torch.zeros(B, T, dtype=torch.int64, device=device)
    positions = torch.tensor([len(s.context) for s in states[:B]], dtype=torch.int64)
    slot_t = torch.tensor(slots[:B], dtype=torch.int64)
    fwd(tokens, positions, slot_t)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fwd(tokens, positions, slot_t)
    sync()
    return 1e3 * (time.perf_counter() - t0) / iters


HEADER = ("| K | mean T fed | tokens/row/step | step ms | forward alone ms | sampling | propose | target launch | "
          "verify | accept | rest (sync wait, commit) |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _line(r: dict) -> str:
    cells = [r["k"], f"{r['mean_T']:.2f}", f"{r['tokens_per_step_per_row']:.2f}", f"{r['step_ms']:.3f}",
             f"{r['forward_alone_ms']:.3f}", *(f"{r[p + '_ms']:.3f}" for p in PHASES), f"{r['rest_ms']:.3f}"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ks", default="0,1,2,4", help="fixed K per run (0: no drafter)")
    p.add_argument("--drafter", choices=("repeat", "lookup"), default="repeat")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (graph captures)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--iters", type=int, default=50, help="back-to-back target passes for 'forward alone'")
    p.add_argument("--out", default=os.environ.get("OUT", "profile-step-out"))
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.prompt_len < 2:
        p.error("--batch and --steps must be >= 1 and --prompt-len >= 2")
    print(HEADER, flush=True)
    result = profile(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_step_{args.shape}_b{args.batch}.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, {args.shape} {args.dtype}, batch {args.batch}, prompts {args.prompt_len} tokens, "
          f"drafter {args.drafter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
