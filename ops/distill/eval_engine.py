"""Acceptance of a drafter measured with the real engine on Spec-Bench prompts (both turns), on CPU.

    python -m ops.distill.eval_engine --draft drafters/smollm2-135m-distill --temperature 0 \
        --out out/eval_greedy.json

For each question: turn 1 through `SpeculativeEngine.stream` (K drafts per target pass), then, for
two-turn questions, turn 2 asked after the engine's own answer. Per target pass the number of accepted
drafts n is read from the committed tokens (n + 1 per pass), giving exact counts per draft position.
Prints mean accepted tokens per target pass (bonus included) overall, per category and per position.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.engine import SpeculativeEngine
from specserve.prompts import SPEC_BENCH_DEV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default=str(SPEC_BENCH_DEV), help="Spec-Bench jsonl (default: the shipped dev set)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--stride", type=int, default=1, help="every n-th question (all categories, fewer prompts)")
    ap.add_argument("--exclude", default="", help="comma-separated question_id[:turn] left out of the summary")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)

    engine = SpeculativeEngine.from_pretrained(args.target, draft=args.draft,
                                               config=EngineConfig(max_batch_size=1, max_seq_len=4096))
    tok = engine.tokenizer
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][:: args.stride][: args.limit]
    records = []
    t_start = time.time()
    for qi, row in enumerate(rows):
        messages: list[dict] = []
        for turn, text in enumerate(row["turns"][:2]):
            messages.append({"role": "user", "content": text})
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok(ids, add_special_tokens=False)["input_ids"]
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                    seed=1000 * int(row["question_id"]) + turn)
            per_step, out = [], []
            t0 = time.perf_counter()
            for ev in engine.stream(ids, params, SpecParams(num_draft_tokens=args.k)):
                if ev.token_ids:
                    per_step.append(len(ev.token_ids))
                    out.extend(ev.token_ids)
                if ev.finished:
                    break
            dt = time.perf_counter() - t0
            answer = tok.decode(out, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            records.append({"question_id": row["question_id"], "category": row["category"], "turn": turn,
                            "tokens": len(out), "passes": len(per_step), "per_step": per_step, "seconds": dt})
        if (qi + 1) % 20 == 0:
            print(f"{qi + 1}/{len(rows)} questions, {time.time() - t_start:.0f} s", file=sys.stderr, flush=True)

    excluded = {e for e in args.exclude.split(",") if e}

    def keep(r: dict) -> bool:
        return str(r["question_id"]) not in excluded and f"{r['question_id']}:{r['turn'] + 1}" not in excluded

    summary = summarize([r for r in records if keep(r)], args.k)
    result = {"draft": args.draft, "k": args.k, "stride": args.stride, "temperature": args.temperature,
              "max_tokens": args.max_tokens, "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "excluded": sorted(excluded),
              "summary": summary, "summary_all": summarize(records, args.k), "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary}, indent=1))


def summarize(records: list[dict], k: int) -> dict:
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    reached, accepted = [0] * k, [0] * k
    for r in records:
        for c in (r["category"], "overall"):
            by_cat[c][0] += r["tokens"]
            by_cat[c][1] += r["passes"]
        for n_emitted in r["per_step"][:-1]:  # the last step may be cut by EOS / max_tokens
            n = n_emitted - 1
            for j in range(k):
                reached[j] += n >= j
                accepted[j] += n >= j + 1
    return {
        "tokens_per_pass": {c: round(t / p, 4) for c, (t, p) in sorted(by_cat.items()) if p},
        "accept_by_position": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "answers": len(records),
    }


if __name__ == "__main__":
    main()
