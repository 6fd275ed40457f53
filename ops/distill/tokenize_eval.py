"""Spec-Bench-style evaluation prompts -> token ids (.npz) for a run without a tokenizer (the GPU machine).

    python -m ops.distill.tokenize_eval specserve/data/spec_bench_dev.jsonl TARGET_FOLDER OUT.npz

Turn 1 becomes the prompt and turn 2 the follow-up asked after the target's own answer. Evaluation only:
these prompts are never trained on.
"""

import sys

from transformers import AutoTokenizer  # noqa: E402

from pipeline.distill.prompts import save_prompts, spec_bench_prompts  # noqa: E402

if __name__ == "__main__":
    src, target, out = sys.argv[1:4]
    prompts = spec_bench_prompts(src, AutoTokenizer.from_pretrained(target))
    save_prompts(prompts, out)
    print(f"{len(prompts)} prompts ({sum(p.followup is not None for p in prompts)} with a second turn) -> {out}")
