"""Acceptance of self-speculation (the target as its own StreamingLLM drafter) at long contexts, on the CPU.

The demo target (SmolLM2-135M-Instruct, real weights; 8,192 positions) drafts for itself through a window of its
own cache (`pipeline.self_spec`: `sinks` attention sinks + the last `window` positions) and verifies with full
attention. Long contexts are Spec-Bench dev's summarization and RAG prompts, concatenated (a chat message ending
with one whole prompt, its instruction included, earlier prompts before it, cut at the front to the context's
length). Each context is prefilled once (in chunks); every (window, K) then decodes greedily from a copy of that
cache. Reported: tokens per target pass (accepted + 1, the figure the speculation speedup multiplies), the
acceptance rate per drafted token, and the host times of a draft forward and a target pass (on the CPU the
eager runner reads every key under a mask, and a draft forward streams all the weights: no speed claim here).
Greedy outputs of every (window, K) are checked against each other token for token (exit status 1 if any differ).

    nice -n 10 python -m ops.bench_self_spec                       # 2k, 4k, 8k x 2 prompts, W 256/512, K 4/6
    python -m ops.bench_self_spec --contexts 2048 --prompts 1 --windows 512 --ks 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

SPEC_BENCH = Path(__file__).resolve().parents[1] / "specserve" / "data" / "spec_bench_dev.jsonl"
MARK = "\u0000CONTENT\u0000"


def long_context(tokenizer, texts: list[str], length: int) -> list[int]:
    """A chat prompt of exactly `length` tokens: the user message is the texts joined, the last one whole (its
    instruction ends the message), cut at the front."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = (tokenizer(part, add_special_tokens=False)["input_ids"] for part in chat.split(MARK))
    content = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    room = length - len(before) - len(after)
    assert len(content) >= room, f"{len(content)} content tokens for a {length}-token context: add texts"
    return before + content[-room:] + after


def prompt_texts(path: Path, count: int, seed: int) -> list[str]:
    """`count` summarization/RAG prompts, starting at an offset that differs per seed (each context its own)."""
    rows = [json.loads(line) for line in path.open()]
    texts = [r["turns"][0] for r in rows if r.get("category") in ("summarization", "rag")]
    start = (seed * 7) % len(texts)
    return [texts[(start + i) % len(texts)] for i in range(count)]


def load_avg() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,4096,8000", help="prompt tokens (the demo target has 8,192 positions)")
    p.add_argument("--prompts", type=int, default=2, help="long contexts per length")
    p.add_argument("--first-prompt", type=int, default=0, help="index of the first long context (another slice)")
    p.add_argument("--windows", default="256,512")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--ks", default="4,6")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench-out/self_spec.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from pipeline.models.store import resolve
    from pipeline.self_spec import SelfSpecDrafter
    from pipeline.sequence import RequestState

    contexts = [int(c) for c in args.contexts.split(",")]
    windows, ks = [int(w) for w in args.windows.split(",")], [int(k) for k in args.ks.split(",")]
    target, tokenizer = load_model(str(resolve(None)), device="cpu", dtype="float32")
    limit = target.info.max_position_embeddings
    longest = max(contexts) + args.max_tokens
    assert longest <= limit, f"context {max(contexts)} + {args.max_tokens} tokens > the target's {limit} positions"
    engine = SpeculativeEngine(target, tokenizer, None, EngineConfig(max_batch_size=2, max_seq_len=longest))
    records: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"# {target.info.name}, {limit} positions; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch threads {args.threads}, load {load_avg():.1f}", flush=True)
    failed = False
    for length in contexts:
        for n in range(args.first_prompt, args.first_prompt + args.prompts):
            ids = long_context(tokenizer, prompt_texts(SPEC_BENCH, 40, seed=n + length), length)
            t0 = time.perf_counter()
            with torch.inference_mode():
                for start in range(0, length - 1, 512):  # the target's prefill into slot 0, in chunks
                    chunk = torch.tensor([ids[start:min(start + 512, length - 1)]])
                    target.forward(chunk, torch.tensor([start]), torch.tensor([0]), chunk.shape[1] - 1)
            prefill_s = time.perf_counter() - t0
            outputs = {}
            for k in ks:
                for window in windows:
                    with torch.inference_mode():
                        for cache in target.k_caches + target.v_caches:
                            cache[1, :, :length].copy_(cache[0, :, :length])
                    drafter = SelfSpecDrafter(target, window, args.sinks)
                    engine.drafter = drafter
                    state = RequestState(request_id=f"{length}-{n}-{window}-{k}", prompt_ids=ids,
                                         params=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0),
                                         eos_token_ids=target.info.eos_token_ids)
                    drafter.assign_slot(state.request_id, 1)
                    before = (engine.timings.draft_s, engine.timings.target_s, engine.timings.steps)
                    load = load_avg()
                    t0 = time.perf_counter()
                    while not state.finished:
                        engine.step([state], [1], SpecParams(k))
                    seconds = time.perf_counter() - t0
                    s = state.stats.summary()
                    steps = engine.timings.steps - before[2]
                    rec = {"context": length, "prompt": n, "window": window, "sinks": args.sinks, "k": k,
                           "tokens_per_pass": s["mean_accepted_tokens"], "acceptance_rate": s["acceptance_rate"],
                           "acceptance_by_position": s["acceptance_by_position"], "tokens": s["generated"],
                           "target_passes": s["target_passes"], "seconds": seconds, "prefill_s": prefill_s,
                           "draft_forward_ms": 1e3 * (engine.timings.draft_s - before[0]) / max(steps * k, 1),
                           "target_pass_ms": 1e3 * (engine.timings.target_s - before[1]) / max(steps, 1),
                           "load": load}
                    records.append(rec)
                    outputs[(window, k)] = list(state.output_ids)
                    print(json.dumps({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in rec.items()
                                      if k_ != "acceptance_by_position"}), flush=True)
                    out.write_text(json.dumps(records, indent=1))
            if len({tuple(o) for o in outputs.values()}) != 1:
                print(f"MISMATCH: greedy outputs differ across windows/K at context {length}, prompt {n}")
                failed = True
    print(table(records))
    return 1 if failed else 0


def table(records: list[dict]) -> str:
    """Markdown: tokens per target pass (mean over prompts) per context, window and K."""
    lines = ["| context | window | K | tokens per target pass | acceptance per drafted token | prompts |",
             "|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["context"], r["window"], r["k"]) for r in records)
    for c, w, k in keys:
        rows = [r for r in records if (r["context"], r["window"], r["k"]) == (c, w, k)]
        tpp = sum(r["tokens"] for r in rows) / sum(r["target_passes"] for r in rows)
        acc = sum(r["acceptance_rate"] for r in rows) / len(rows)
        lines.append(f"| {c} | {w} | {k} | {tpp:.2f} | {acc:.2f} | {len(rows)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
