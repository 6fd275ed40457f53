"""The evaluation prompts that ship with specserve: the Spec-Bench dev set (specserve/data/spec_bench_dev.jsonl,
Apache-2.0, see specserve/data/SPEC_BENCH_LICENSE), 240 questions in six categories.

They are the default prompts of `specserve bench` and `specserve bench-serve`, and `specserve distill
--eval-prompts` evaluates on them; they are never training data (distillation refuses training prompts that
share an 8-gram with its evaluation prompts).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPEC_BENCH_DEV = Path(__file__).resolve().parent / "data" / "spec_bench_dev.jsonl"
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@dataclass
class Sample:
    question_id: Any
    category: str  # Spec-Bench's six: mt_bench, translation, summarization, qa, math_reasoning, rag
    prompt: str


def load_prompts(path: str | Path, per_category: int) -> list[Sample]:
    """The first `per_category` prompts of each Spec-Bench category in a Spec-Bench jsonl, categories sorted
    (MT-Bench's eight count as one, `mt_bench`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    by_cat: dict[str, list[Sample]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        cat = "mt_bench" if row["category"] in MT_BENCH else row["category"]
        by_cat[cat].append(Sample(row.get("question_id"), cat, row["turns"][0]))
    return [s for cat in sorted(by_cat) for s in by_cat[cat][:per_category]]
