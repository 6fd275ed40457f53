"""Prompts for distillation and evaluation, as token ids.

A `Prompt` is a chat rendered with the target's template, ending where the assistant's answer starts,
plus an optional `followup`: the tokens that close the target's answer and ask a second user turn (so
multi-turn data is the target answering after its own first answer, as in serving).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

_PLACEHOLDER = "\u2063SPECSERVE_ANSWER\u2063"


@dataclass
class Prompt:
    ids: list[int]  # rendered chat, ending with the assistant header
    followup: list[int] | None  # appended after the answer (its trailing EOS removed) to ask turn 2
    category: str


def encode_chat(tokenizer: Any, messages: list[dict],
                followup: str | None = None) -> tuple[list[int], list[int] | None]:
    """Token ids of `messages` with the generation prompt, and of the follow-up segment (or None).

    The follow-up segment is what the chat template puts between the assistant's answer text and the
    next assistant header (for ChatML: `<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`).
    Without a chat template, turns are joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if followup is None:
        return ids, None
    if getattr(tokenizer, "chat_template", None):
        conv = messages + [{"role": "assistant", "content": _PLACEHOLDER}, {"role": "user", "content": followup}]
        full = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        head, tail = full.split(_PLACEHOLDER, 1)
        assert head == text, "chat template renders the first turn differently once an answer follows"
    else:
        eos = tokenizer.eos_token or ""
        tail = f"{eos}\n\n{followup}\n\n"
    return ids, tokenizer(tail, add_special_tokens=False)["input_ids"]


def load_prompts(path: str | Path, tokenizer: Any | None) -> list[Prompt]:
    """Prompts from a `.jsonl`/`.jsonl.gz` of chats (needs the tokenizer) or an `.npz` of token ids.

    jsonl rows: {"messages": [...], "followups": [str], "category": str} or {"prompt": str} or
    {"input_ids": [int], "followup_ids": [int] | null}.
    """
    path = Path(path)
    if path.suffix == ".npz":
        import numpy as np

        z = np.load(path)
        ids, off = z["ids"].astype(np.int64), z["offsets"]
        fids, foff = z["followup_ids"].astype(np.int64), z["followup_offsets"]
        names = [str(n) for n in z["category_names"]]
        out = []
        for i in range(len(off) - 1):
            f = fids[foff[i] : foff[i + 1]].tolist()
            out.append(Prompt(ids[off[i] : off[i + 1]].tolist(), f or None, names[int(z["category"][i])]))
        return out
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                out.append(prompt_from_row(json.loads(line), tokenizer))
    return out


def save_prompts(prompts: Sequence[Prompt], path: str | Path) -> None:
    """Store prompts as token ids (`.npz`, read back by `load_prompts`): no tokenizer needed to use them."""
    import numpy as np

    names = sorted({p.category for p in prompts})
    ids = [t for p in prompts for t in p.ids]
    fids = [t for p in prompts for t in (p.followup or [])]
    offsets = np.cumsum([0] + [len(p.ids) for p in prompts])
    foffsets = np.cumsum([0] + [len(p.followup or []) for p in prompts])
    dtype = np.uint16 if max(ids + fids, default=0) < 65536 else np.int32
    np.savez_compressed(path, ids=np.asarray(ids, dtype), offsets=offsets.astype(np.int64),
                        followup_ids=np.asarray(fids, dtype), followup_offsets=foffsets.astype(np.int64),
                        category=np.asarray([names.index(p.category) for p in prompts], np.int16),
                        category_names=np.asarray(names))


def prompt_from_row(row: dict, tokenizer: Any | None) -> Prompt:
    category = str(row.get("category", "default"))
    if "input_ids" in row:
        return Prompt(list(row["input_ids"]), row.get("followup_ids") or None, category)
    if tokenizer is None:
        raise ValueError("text prompts need the target's tokenizer (this target folder has none)")
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    followups = row.get("followups") or []
    ids, follow = encode_chat(tokenizer, messages, followups[0] if followups else None)
    return Prompt(ids, follow, category)


def spec_bench_prompts(path: str | Path, tokenizer: Any) -> list[Prompt]:
    """Spec-Bench rows ({"category", "turns": [str, ...]}): turn 1 as the prompt, turn 2 as the follow-up."""
    out = []
    for line in open(path):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row["turns"]
        ids, follow = encode_chat(tokenizer, [{"role": "user", "content": turns[0]}],
                                  turns[1] if len(turns) > 1 else None)
        out.append(Prompt(ids, follow, row["category"]))
    return out


def synthetic_prompts(n: int, vocab_size: int, seed: int, min_len: int = 4, max_len: int = 24,
                      special: Sequence[int] = ()) -> list[Prompt]:
    """Random-token prompts for targets without a tokenizer (tests): the data is whatever the target writes."""
    rng = random.Random(seed)
    lo = max(special, default=-1) + 1
    out = []
    for i in range(n):
        ids = [rng.randrange(lo, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        follow = [rng.randrange(lo, vocab_size) for _ in range(3)] if i % 4 == 0 else None
        out.append(Prompt(ids, follow, f"synthetic{i % 2}"))
    return out
