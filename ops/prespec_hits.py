"""How often pre-speculation would have the next draft ready, by branch budget, for a real drafter (no Ray).

    python -m ops.prespec_hits --per-category 1 --max-tokens 128 -k 4 --budgets 1,2,4,8

Runs the demo pair (or `--target` / `--draft`) through the Serve workers' classes in this process, greedy, a fixed
K, the way the coordinator drives them: each step the drafter drafts K+1 tokens (the last: its guess of the bonus
token), `pipeline.prespec.rank_branches` ranks the step's outcomes by the drafter's own probabilities, the target
verifies. The outcome's rank among the branches says which budgets would have hit: a hit at budget B is an outcome
ranked below B. Hits depend only on the outcomes, not on timing, so one run gives every budget's hit rate.
Prints the hit rate per budget, overall and by accepted length, and the drafter's time for a pass of B branch rows
against one row (the extra work a budget costs the drafter's device).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model folder (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft model folder (default: the demo target's drafter model)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--budgets", default="1,2,4,8")
    p.add_argument("--top-m", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from deployments.batching import AGAIN
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import PrespecCall, ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from pipeline.config import SamplingParams
    from pipeline.drafters import draft_model_spec
    from pipeline.engine import default_draft
    from pipeline.models.loader import load_tokenizer
    from pipeline.models.store import resolve
    from pipeline.prespec import match_branch, rank_branches
    from pipeline.sequence import RequestState
    from pipeline.step import commit
    from specserve.prompts import SPEC_BENCH_DEV, load_prompts

    budgets = [int(b) for b in args.budgets.split(",")]
    target_path = str(resolve(args.target))
    draft_path = str(resolve(args.draft or draft_model_spec(default_draft(None))))
    tokenizer = load_tokenizer(target_path)
    samples = load_prompts(str(SPEC_BENCH_DEV), args.per_category)
    prompts = []
    for s in samples:  # as `SpeculativeEngine.encode(prompt, chat=True)`
        ids = tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    seq = max(len(x) for x in prompts) + args.max_tokens + 16
    target = TargetWorker(target_path, max_batch_size=1, max_seq_len=seq, torch_threads=args.threads)
    drafter = DrafterWorker(draft_path, max_batch_size=1, max_seq_len=seq, torch_threads=args.threads,
                            prespec_branches=max(budgets))
    eos = tuple(asyncio.run(target.info())["eos_token_ids"])
    print(f"target {target_path}\ndrafter {draft_path}\n{len(prompts)} prompts, K={args.k}, greedy, "
          f"max_tokens={args.max_tokens}, load average {os.getloadavg()[0]:.1f}")
    ranks: list[tuple[int, int]] = []  # per step: (accepted length, rank of the outcome among the branches or -1)
    one_row_s, branch_s = [], []
    for i, ids in enumerate(prompts):
        rid = f"p{i}"
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=0)
        state = RequestState(rid, list(ids), params, eos_token_ids=eos)
        for w in (target, drafter):
            asyncio.run(w.admit(rid))
        first = True
        while not state.finished:
            want = min(args.k, state.remaining - 1)
            if want <= 0:
                draft = None
            else:
                t0 = time.perf_counter()
                answer = drafter._run_batch([ProposeCall(rid, 0, state.context, want + 1, params, state.step, 64)])[0]
                one_row_s.append(time.perf_counter() - t0)
                draft = answer.head(want)
                branches = rank_branches(answer.tokens, answer.top_ids, answer.top_probs, want, max(budgets),
                                         args.top_m)
                tails = [b.tail(draft.tokens) for b in branches]
                t0 = time.perf_counter()
                drafter._run_batch([PrespecCall(rid, 0, state.context, tails, [args.k + 1] * len(tails), params,
                                                state.step + 1, 64)])
                branch_s.append((len(tails), time.perf_counter() - t0))
            base = state.length
            call = VerifyCall(rid, state.length - 1, state.last_token, draft or _empty(), params, state.step,
                              prefix=state.context[:-1] if first else None)
            first = False
            verdict = target._run_batch([call])[0]
            while verdict == AGAIN:  # a long prompt prefills a chunk a pass
                verdict = target._run_batch([call])[0]
            commit(state, verdict)
            if draft is not None and not state.finished:
                ranks.append((verdict.num_accepted, match_branch(tails, state.context, base)))
        for w in (target, drafter):
            asyncio.run(w.release([rid]))
        print(f"prompt {i}: {len(state.output_ids)} tokens, {state.step} steps", flush=True)

    print(f"\n{len(ranks)} steps verified with a next step to draft; pre-speculation hits by branch budget "
          f"(top-m {args.top_m}), load average {os.getloadavg()[0]:.1f}:\n")
    lengths = sorted({n for n, _ in ranks})
    print("| budget | hit rate | " + " | ".join(f"accepted {n} ({sum(1 for m, _ in ranks if m == n)} steps)"
                                              for n in lengths) + " |")
    print("|---" * (len(lengths) + 2) + "|")
    for b in budgets:
        hit = [0 <= r < b for _, r in ranks]
        by = [sum(0 <= r < b for m, r in ranks if m == n) / max(1, sum(1 for m, _ in ranks if m == n))
              for n in lengths]
        print(f"| {b} | {statistics.mean(hit):.2f} | " + " | ".join(f"{x:.2f}" for x in by) + " |")
    rows = {}
    for n, s in branch_s:
        rows.setdefault(n, []).append(s)
    one = 1e3 * statistics.median(one_row_s)
    print(f"\ndrafter pass, K+1 = {args.k + 1} tokens: one row (a fresh draft) {one:.1f} ms median; "
          "branch rows: " + ", ".join(f"{n} rows {1e3 * statistics.median(v):.1f} ms"
                                                for n, v in sorted(rows.items())))
    return 0


def _empty():
    from pipeline.step import Draft

    return Draft([])


if __name__ == "__main__":
    raise SystemExit(main())
