"""Sequence-level distillation data: the target's own answers to prompts, generated in big batches.

Prompts are processed in fixed chunks (`chunk_prompts`), each written to its own shard
(`data/shard_00000.npz`): an interrupted run resumes at the first missing shard, and the prompt order is
fixed by the seed, so a resumed run produces the same data. Within a chunk, a seeded fraction of the
prompts is answered by sampling (temperature `sample_temperature`), the rest greedily; prompts with a
follow-up are then asked their second turn after the target's own first answer (a second round).

Two backends answer the prompts. `model` is either a Hugging Face causal LM (batched `generate`, below:
`--gen-backend hf`) or a `fastgen.RunnerGenerator` (this project's runner with continuous batching, the
default: about an order of magnitude more answer tokens per second on a GPU). Both keep these semantics;
`generate_chunk` and `generate_dataset` hand the work to the runner backend when given one.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pipeline.distill.prompts import Prompt


@dataclass
class SampleSet:
    """Token sequences (prompt + the target's answer), concatenated."""

    ids: np.ndarray  # [total] int32
    offsets: np.ndarray  # [n + 1] int64: sample i is ids[offsets[i]:offsets[i+1]]
    prompt_lens: np.ndarray  # [n] int32: the first prompt_lens[i] tokens are the prompt
    category: np.ndarray  # [n] int16 index into names
    sampled: np.ndarray  # [n] bool: answer sampled (True) or greedy (False)
    names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def response_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    @classmethod
    def build(cls, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int], categories: Sequence[str],
              sampled: Sequence[bool]) -> "SampleSet":
        names = sorted(set(categories))
        lens = np.asarray([len(s) for s in seqs], dtype=np.int64)
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]) if seqs else np.zeros(0, np.int32)
        return cls(ids, offsets, np.asarray(prompt_lens, dtype=np.int32),
                   np.asarray([names.index(c) for c in categories], dtype=np.int16),
                   np.asarray(sampled, dtype=bool), names)

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, ids=self.ids, offsets=self.offsets, prompt_lens=self.prompt_lens, category=self.category,
                 sampled=self.sampled, names=np.asarray(self.names, dtype=str))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "SampleSet":
        z = np.load(path)
        return cls(z["ids"], z["offsets"], z["prompt_lens"], z["category"], z["sampled"], [str(n) for n in z["names"]])

    @classmethod
    def concat(cls, sets: Sequence["SampleSet"]) -> "SampleSet":
        names = sorted({n for s in sets for n in s.names})
        seqs, plens, cats, samp = [], [], [], []
        for s in sets:
            for i in range(len(s)):
                seqs.append(s.seq(i))
                plens.append(int(s.prompt_lens[i]))
                cats.append(s.names[int(s.category[i])])
                samp.append(bool(s.sampled[i]))
        out = cls.build(seqs, plens, cats, samp)
        assert out.names == names or not seqs
        return out


def _batches(lengths: Sequence[int], max_new: int, budget: int, max_batch: int) -> list[list[int]]:
    """Index batches, similar lengths together, each within `budget` padded positions."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[i] + max_new  # sorted ascending: the newest row is the longest
        if cur and ((len(cur) + 1) * width > budget or len(cur) >= max_batch):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def generate_answers(
    model: Any,
    inputs: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,  # 0: greedy
    eos_ids: Sequence[int],
    pad_id: int,
    batch_tokens: int,
    max_batch: int,
    seed: int,
) -> list[list[int]]:
    """The target's answer to each input (ending with its EOS token, or cut at max_new_tokens)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    if temperature > 0:
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0,
                              top_p=1.0, eos_token_id=list(eos_ids), pad_token_id=pad_id)
    else:
        gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                              pad_token_id=pad_id)
    answers: list[list[int]] = [[] for _ in inputs]
    eos = set(eos_ids)
    for bi, batch in enumerate(_batches([len(x) for x in inputs], max_new_tokens, batch_tokens, max_batch)):
        width = max(len(inputs[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):  # left padding
            n = len(inputs[i])
            ids[r, width - n :] = torch.as_tensor(list(inputs[i]), dtype=torch.long)
            mask[r, width - n :] = 1
        torch.manual_seed(seed * 1000003 + bi)
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc)
        new = out[:, width:].tolist()
        for r, i in enumerate(batch):
            toks = new[r]
            cut = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
            answers[i] = toks[:cut]
    return answers


def generate_chunk(
    model: Any, prompts: Sequence[Prompt], *, seed: int, sample_fraction: float, sample_temperature: float,
    max_new_tokens: int, eos_ids: Sequence[int], pad_id: int, batch_tokens: int, max_batch: int,
) -> SampleSet:
    """Answer every prompt (greedy or sampled), then every follow-up after the target's own answer."""
    if getattr(model, "continuous_batching", False):  # fastgen.RunnerGenerator
        return model.generate_chunk(prompts, seed=seed, sample_fraction=sample_fraction,
                                    sample_temperature=sample_temperature, max_new_tokens=max_new_tokens,
                                    eos_ids=eos_ids)
    rng = random.Random(seed)
    modes = [rng.random() < sample_fraction for _ in prompts]
    seqs, plens, cats, samp = [], [], [], []
    for sampled in (False, True):
        idx = [i for i, m in enumerate(modes) if m == sampled]
        if not idx:
            continue
        kw = dict(max_new_tokens=max_new_tokens, temperature=sample_temperature if sampled else 0.0, eos_ids=eos_ids,
                  pad_id=pad_id, batch_tokens=batch_tokens, max_batch=max_batch)
        first = generate_answers(model, [prompts[i].ids for i in idx], seed=seed * 2 + sampled, **kw)
        second_in, second_idx = [], []
        for i, ans in zip(idx, first):
            p = prompts[i]
            seqs.append(p.ids + ans)
            plens.append(len(p.ids))
            cats.append(p.category)
            samp.append(sampled)
            if p.followup:
                body = ans[:-1] if ans and ans[-1] in set(eos_ids) else ans
                second_in.append(p.ids + body + p.followup)
                second_idx.append(i)
        if second_in:
            second = generate_answers(model, second_in, seed=seed * 2 + sampled + 7919, **kw)
            for i, inp, ans in zip(second_idx, second_in, second):
                seqs.append(inp + ans)
                plens.append(len(inp))
                cats.append(prompts[i].category)
                samp.append(sampled)
    return SampleSet.build(seqs, plens, cats, samp)


def generate_dataset(
    model: Any, prompts: Sequence[Prompt], data_dir: Path, *, chunk_prompts: int, token_budget: int,
    seconds_budget: float | None, seed: int, progress: Callable[[str], None] = print, **kw: Any,
) -> SampleSet:
    """Shards of target answers until `token_budget` response tokens (or `seconds_budget`) is reached."""
    if getattr(model, "continuous_batching", False):  # fastgen.RunnerGenerator: one stream over the chunks
        return model.generate_dataset(prompts, data_dir, chunk_prompts=chunk_prompts, token_budget=token_budget,
                                      seconds_budget=seconds_budget, seed=seed, progress=progress, **kw)
    data_dir.mkdir(parents=True, exist_ok=True)
    sets: list[SampleSet] = []
    tokens = 0
    t0 = time.perf_counter()
    for c, start in enumerate(range(0, len(prompts), chunk_prompts)):
        if tokens >= token_budget:
            break
        shard = data_dir / f"shard_{c:05d}.npz"
        if shard.exists():
            s = SampleSet.load(shard)
        else:
            if seconds_budget is not None and time.perf_counter() - t0 >= seconds_budget:
                break
            t1 = time.perf_counter()
            s = generate_chunk(model, prompts[start : start + chunk_prompts], seed=seed + c, **kw)
            s.save(shard)
            dt = time.perf_counter() - t1
            progress(f"data shard {c}: {len(s)} samples, {s.response_tokens} answer tokens in {dt:.1f} s "
                     f"({s.response_tokens / max(dt, 1e-9):.0f} tok/s)")
        sets.append(s)
        tokens += s.response_tokens
    if not sets:
        raise RuntimeError("no distillation data: the prompt list is empty or the budget is zero")
    return SampleSet.concat(sets)
