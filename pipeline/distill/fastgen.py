"""Distillation data on this project's own runner: continuous batching over the slot-indexed KV cache.

The Hugging Face path (`generate.generate_answers`) pads a batch to its longest prompt and decodes until its
longest answer ends: every step pays ~80 ms of eager Python whatever the batch still holds. Here the target
runs as `pipeline.models` serves it (`load_model` -> `LlamaCausalLM`, optionally wrapped by
`graphs.maybe_graphs`: one captured CUDA graph per decoding step), and

- `rows` requests decode together, one cache slot each (row r owns slot r);
- a row that ends (an EOS token, or `max_new_tokens`) frees its slot; free slots are refilled from the queue
  as soon as `refill_min` of them are free (or the queue can no longer fill more), all in one prefill call,
  so the eager prefill's fixed cost is paid once per group rather than once per request;
- a prefill writes the prompt's first n-1 tokens into the slot; the last prompt token is the row's first
  *decoding* input, so prefill needs no logits and every sampled token comes out of the one decoding step;
- queued work is a stream: follow-up turns (asked after the target's own first answer) go to the front of
  the queue, the next chunk of prompts joins at the back, so slots never wait for a chunk to drain.

Tokens: greedy rows take the argmax of the float32 logits (what HF `generate(do_sample=False)` does);
sampled rows draw from softmax(logits / T) over the full vocabulary (HF with top_k=0, top_p=1) by inverse
CDF with a counter-based uniform (`pipeline.rng`): token j of a job is a pure function of the job's seed,
j and the logits. Answers therefore do not depend on the batch they shared, the row they landed in or
the order jobs were refilled in (up to the floating-point differences of other batch shapes in bf16).

Data semantics are those of `generate.generate_chunk`: a seeded fraction of a chunk's prompts is sampled,
the rest greedy; prompts with a follow-up are asked their second turn after the target's own first answer
(its trailing EOS removed); the chunk's `SampleSet` lists greedy first turns, greedy second turns, sampled
first turns, sampled second turns, each in prompt order. `generate_dataset` keeps the shard files
(`shard_00000.npz`, one per chunk, resumable) and the token/seconds budgets, checked when a chunk is admitted.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from pipeline.distill.generate import SampleSet
from pipeline.distill.prompts import Prompt
from pipeline.rng import Stream, uniform
from pipeline.sampling import sample_from_probs


@dataclass
class Job:
    """One answer to write: the target continues `ids`."""

    ids: list[int]
    temperature: float  # 0: greedy
    seed: int  # sampling seed (0 <= seed < 2**63); token j uses uniform(seed, step=j)
    tag: Any = None  # the caller's handle


@dataclass
class BatchStats:
    steps: int = 0  # decoding steps
    decode_tokens: int = 0  # tokens produced (= answer tokens)
    row_steps: int = 0  # rows x steps (occupancy = decode_tokens / row_steps)
    prefill_calls: int = 0
    prefill_tokens: int = 0  # prompt tokens written by prefill
    jobs: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["occupancy"] = round(self.decode_tokens / max(self.row_steps, 1), 4)
        d["ms_per_step"] = round(1000 * self.decode_s / max(self.steps, 1), 3)
        d["decode_s"], d["prefill_s"] = round(self.decode_s, 2), round(self.prefill_s, 2)
        return d


def job_seed(seed: int, index: int, turn: int) -> int:
    """Distinct sampling seed of (chunk seed, prompt index, turn): 31 bits each, never negative."""
    return ((seed & 0x7FFFFFFF) << 32) | ((2 * index + turn) & 0xFFFFFFFF)


class ContinuousBatcher:
    """Decode many jobs on one `CausalLM` (runner or `GraphCausalLM`), `rows` at a time."""

    def __init__(self, model: Any, *, rows: int, max_len: int, eos_ids: Sequence[int], refill_min: int | None = None,
                 prefill_tokens: int = 65536, prefill_attention: int = 1 << 26) -> None:
        assert rows >= 1 and max_len >= 2, f"need rows >= 1 and max_len >= 2, got {rows}, {max_len}"
        self.model, self.rows, self.max_len = model, rows, max_len
        self.eos = frozenset(int(e) for e in eos_ids)
        self.refill_min = max(1, min(rows, refill_min if refill_min else max(1, rows // 8)))
        # Per prefill call: rows x padded length, and rows x length^2 (the eager runner's attention may
        # materialise [rows, heads, length, length] scores: 2^26 x 9 heads x 4 bytes = 2.4 GB for the demo).
        # Measured with a dummy model on real-like lengths (chunks sorted by length, 512 rows, refill at 64
        # free): one prefill call per ~16 decoding steps, occupancy 0.91, 0.45 ms of host time per step.
        self.prefill_tokens = prefill_tokens
        self.prefill_attention = prefill_attention
        if model.num_slots != rows or model.max_len != max_len:  # keep an allocated cache (and captured graphs)
            model.allocate(rows, max_len)
        p = _first_param(model)
        self.device = p.device
        self.stats = BatchStats()

    # -- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, source: Callable[[], list[Job] | None] | Iterable[Job], max_new_tokens: int,
            on_done: Callable[[Job, list[int]], list[Job] | None]) -> BatchStats:
        """Decode until `source` is exhausted and every job (and every job `on_done` returns) has its answer.

        `source`: a callable returning the next list of jobs (None when there are no more; asked whenever fewer
        than `rows` jobs wait), or an iterable of jobs. `on_done(job, answer)` gets each answer (ending with an
        EOS token, or `max_new_tokens` long) and may return follow-up jobs, which run before anything queued.
        """
        if not callable(source):
            source = _once(list(source))
        rows, dev = self.rows, self.device
        pending: deque[Job] = deque()
        exhausted = False
        job: list[Job | None] = [None] * rows
        pos = [0] * rows  # position of the token each row feeds next
        ans: list[list[int]] = [[] for _ in range(rows)]
        tok = torch.zeros(rows, dtype=torch.long, device=dev)  # the token each row feeds next
        while True:
            while not exhausted and len(pending) < rows:
                more = source()
                if more is None:
                    exhausted = True
                else:
                    pending.extend(more)
            free = [r for r in range(rows) if job[r] is None]
            if pending and free and (len(free) >= min(self.refill_min, len(pending)) or len(free) == rows):
                take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
                self._refill(free[: len(take)], take, max_new_tokens, job, pos, ans, tok)
            act = [r for r in range(rows) if job[r] is not None]
            if not act:
                if pending or not exhausted:
                    continue
                return self.stats
            t0 = time.perf_counter()
            nxt = self._step(act, job, pos, ans, tok)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.steps += 1
            self.stats.row_steps += rows
            self.stats.decode_tokens += len(act)
            front: list[Job] = []
            for r, t in zip(act, nxt):
                a = ans[r]
                a.append(t)
                pos[r] += 1
                if t in self.eos or len(a) >= max_new_tokens:
                    done, job[r], ans[r] = job[r], None, []
                    self.stats.jobs += 1
                    extra = on_done(done, a)
                    if extra:
                        front.extend(extra)
            if front:
                pending.extendleft(reversed(front))

    def _refill(self, free: list[int], take: list[Job], max_new: int, job: list, pos: list, ans: list,
                tok: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for r, j in zip(free, take):
            n = len(j.ids)
            if n < 1 or n + max_new > self.max_len:
                raise ValueError(f"a job of {n} tokens + {max_new} new does not fit max_len {self.max_len}")
            job[r], pos[r], ans[r] = j, n - 1, []
        # Prefill ids[:-1] of every job longer than one token, grouped by length (fewest padded positions).
        order = sorted((r for r in free[: len(take)] if len(job[r].ids) > 1), key=lambda r: len(job[r].ids))
        group: list[int] = []
        for r in order + [None]:
            if r is not None:
                width = len(job[r].ids) - 1  # ascending: the newest row is the longest
                n = len(group) + 1
                if not group or (n * width <= self.prefill_tokens and n * width * width <= self.prefill_attention):
                    group.append(r)
                    continue
            self._prefill(group, job)
            group = [r] if r is not None else []
        rows_t = torch.tensor(free[: len(take)], dtype=torch.long)
        last = torch.tensor([job[r].ids[-1] for r in free[: len(take)]], dtype=torch.long)
        tok[rows_t.to(tok.device)] = last.to(tok.device)
        self.stats.prefill_s += time.perf_counter() - t0

    def _prefill(self, group: list[int], job: list) -> None:
        if not group:
            return
        width = max(len(job[r].ids) - 1 for r in group)
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        for i, r in enumerate(group):
            ids = job[r].ids[:-1]
            tokens[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        # Right padding writes K/V past a row's prompt; decoding overwrites those positions before any query
        # reaches them (base.py). The logits are not needed: the last prompt token is fed by the next step.
        self.model.forward(tokens.to(self.device), torch.zeros(len(group), dtype=torch.long),
                           torch.tensor(group, dtype=torch.long), logits_from=width - 1)
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(len(job[r].ids) - 1 for r in group)

    def _step(self, act: list[int], job: list, pos: list, ans: list, tok: torch.Tensor) -> list[int]:
        dev = self.device
        act_cpu = torch.tensor(act, dtype=torch.long)
        act_dev = act_cpu.to(dev, non_blocking=True)
        positions = torch.tensor([pos[r] for r in act], dtype=torch.long)  # host positions: no sync to bucket
        logits = self.model.forward(tok[act_dev][:, None], positions, act_cpu)[:, -1]  # [B, V] float32
        nxt = logits.argmax(-1)
        samp = [i for i, r in enumerate(act) if job[r].temperature > 0]
        if samp:
            idx = torch.tensor(samp, dtype=torch.long, device=dev)
            temps = torch.tensor([job[act[i]].temperature for i in samp], dtype=torch.float32, device=dev)
            seeds = torch.tensor([job[act[i]].seed for i in samp], dtype=torch.long, device=dev)
            steps = torch.tensor([len(ans[act[i]]) for i in samp], dtype=torch.long, device=dev)
            probs = torch.softmax(logits[idx] / temps[:, None], dim=-1)
            u = uniform(seeds, steps, Stream.TARGET, 1)[:, 0]
            nxt[idx] = sample_from_probs(probs, u)
        tok[act_dev] = nxt
        return nxt.tolist()


def _first_param(model: Any) -> torch.Tensor:
    inner = getattr(model, "runner", model)  # GraphCausalLM wraps the runner
    m = getattr(inner, "model", inner)
    return next(m.parameters())


# ----------------------------------------------------------------------------------------------------
# Chunks: the data semantics of generate.generate_chunk


class _Chunk:
    """One chunk of prompts in flight: its jobs, answers, and the SampleSet once every answer is in."""

    def __init__(self, index: int, prompts: Sequence[Prompt], seed: int, sample_fraction: float,
                 sample_temperature: float, eos: frozenset[int], descending: bool = False) -> None:
        self.index, self.prompts, self.seed, self.eos = index, prompts, seed, eos
        rng = random.Random(seed)  # as generate_chunk: one draw per prompt, in order
        self.modes = [rng.random() < sample_fraction for _ in prompts]
        self.temperature = sample_temperature
        self.first: list[list[int] | None] = [None] * len(prompts)
        self.second: list[list[int] | None] = [None] * len(prompts)
        self.outstanding = len(prompts)
        self.answer_tokens = 0
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids), reverse=descending)
        self.jobs = [self._job(i, 0, prompts[i].ids) for i in order]

    def _job(self, i: int, turn: int, ids: list[int]) -> Job:
        t = self.temperature if self.modes[i] else 0.0
        return Job(list(ids), t, job_seed(self.seed, i, turn), (self, i, turn))

    def done(self, i: int, turn: int, answer: list[int]) -> Job | None:
        self.answer_tokens += len(answer)
        self.outstanding -= 1
        if turn == 1:
            self.second[i] = answer
            return None
        self.first[i] = answer
        p = self.prompts[i]
        if not p.followup:
            return None
        self.outstanding += 1
        body = answer[:-1] if answer and answer[-1] in self.eos else answer
        return self._job(i, 1, p.ids + body + p.followup)

    def result(self) -> SampleSet:
        seqs, plens, cats, samp = [], [], [], []
        for sampled in (False, True):
            idx = [i for i, m in enumerate(self.modes) if m == sampled]
            for i in idx:
                p = self.prompts[i]
                seqs.append(p.ids + self.first[i])
                plens.append(len(p.ids))
                cats.append(p.category)
                samp.append(sampled)
            for i in idx:
                p = self.prompts[i]
                if p.followup:
                    a = self.first[i]
                    inp = p.ids + (a[:-1] if a and a[-1] in self.eos else a) + p.followup
                    seqs.append(inp + self.second[i])
                    plens.append(len(inp))
                    cats.append(p.category)
                    samp.append(sampled)
        return SampleSet.build(seqs, plens, cats, samp)


def max_job_len(prompts: Iterable[Prompt], max_new_tokens: int) -> int:
    """Cache positions the longest job of these prompts can reach (second turns included)."""
    need = 2
    for p in prompts:
        n = len(p.ids) + max_new_tokens
        if p.followup:
            n += len(p.followup) + max_new_tokens
        need = max(need, n)
    return need


@dataclass
class RunnerGenerator:
    """The target on this project's runner, for `generate.generate_chunk` / `generate_dataset`.

    Build it with `RunnerGenerator.load(...)`; it allocates `rows` cache slots of `max_len` positions.
    """

    model: Any  # CausalLM (LlamaCausalLM, GraphCausalLM, or the generic HF runner)
    rows: int
    max_len: int
    refill_min: int | None = None
    stats: list[dict] = field(default_factory=list)  # one BatchStats summary per run
    continuous_batching: bool = True  # generate.py dispatches on this

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device, dtype: str, *, rows: int, max_len: int,
             graphs: bool | None = None, compile: bool | None = None, attention: str = "auto",
             refill_min: int | None = None, kv_block: int = 256) -> "RunnerGenerator":
        """`path`: a model folder (`pipeline.models.loader.load_model`). graphs: wrap the runner in
        `GraphCausalLM` (None: on CUDA) with one batch bucket (`rows`: padding rows cost a scratch slot)
        and decoding only (T = 1); prefill always runs eagerly."""
        from pipeline.models.loader import load_model

        runner, _ = load_model(path, device=device, dtype=dtype)
        return cls.wrap(runner, rows=rows, max_len=max_len, graphs=graphs, compile=compile, attention=attention,
                        refill_min=refill_min, kv_block=kv_block)

    @classmethod
    def wrap(cls, runner: Any, *, rows: int, max_len: int, graphs: bool | None = None, compile: bool | None = None,
             attention: str = "auto", refill_min: int | None = None, kv_block: int = 256) -> "RunnerGenerator":
        device = _first_param(runner).device
        use_static = (device.type == "cuda") if graphs is None else graphs
        model = runner
        if use_static:
            from pipeline.models.graphs import GraphConfig, maybe_graphs

            kw: dict[str, Any] = dict(batch_buckets=(rows,), token_buckets=(1,), kv_block=kv_block,
                                      graphs=device.type == "cuda", compile=compile)
            if "attention" in {f.name for f in dataclasses.fields(GraphConfig)}:
                kw["attention"] = attention
            model = maybe_graphs(runner, GraphConfig(**kw))
        max_len = -(-max_len // kv_block) * kv_block
        return cls(model, rows, max_len, refill_min)

    @property
    def static(self) -> bool:
        return hasattr(self.model, "runner")

    @torch.inference_mode()
    def self_check(self, prompts: Sequence[Sequence[int]], length: int = 32) -> dict[str, Any]:
        """One decoding step of the static path against the eager runner (same cache, same inputs): the
        relative logit error and the argmax agreement, over up to `rows` prompts cut to `length` + 1 tokens."""
        runner = getattr(self.model, "runner", None)
        cut = [list(p[: length + 1]) for p in prompts if len(p) > length][: self.rows]
        if runner is None or not cut:
            return {"ok": True, "checked": 0, "static": runner is not None}
        if self.model.num_slots != self.rows or self.model.max_len != self.max_len:
            self.model.allocate(self.rows, self.max_len)
        dev = _first_param(self.model).device
        n = len(cut)
        toks = torch.tensor(cut, dtype=torch.long, device=dev)
        slots = torch.arange(n, dtype=torch.long)
        runner.forward(toks[:, :length], torch.zeros(n, dtype=torch.long), slots, logits_from=length - 1)
        pos = torch.full((n,), length, dtype=torch.long)
        eager = runner.forward(toks[:, length:], pos, slots)[:, -1].float()
        static = self.model.forward(toks[:, length:], pos, slots)[:, -1].float()
        rel = float((eager - static).norm() / eager.norm().clamp_min(1e-12))
        agree = float((eager.argmax(-1) == static.argmax(-1)).float().mean())
        return {"ok": rel <= 0.05 and agree >= 0.9, "checked": n, "rel_err": round(rel, 6),
                "argmax_agree": round(agree, 4), "static": True}

    def release(self) -> None:
        """Free the KV cache (and captured graphs) now."""
        inner = getattr(self.model, "runner", self.model)
        for name in ("k_caches", "v_caches"):
            if hasattr(inner, name):
                setattr(inner, name, [])
        self.model = None
        import gc

        gc.collect()  # captured graphs hold their memory pool until collected
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def batcher(self, eos_ids: Sequence[int]) -> ContinuousBatcher:
        return ContinuousBatcher(self.model, rows=self.rows, max_len=self.max_len, eos_ids=eos_ids,
                                 refill_min=self.refill_min)

    def answers(self, jobs: Sequence[Job], *, max_new_tokens: int, eos_ids: Sequence[int]) -> list[list[int]]:
        """The answer to each job (no follow-ups), in order."""
        out: list[list[int] | None] = [None] * len(jobs)
        tagged = [Job(j.ids, j.temperature, j.seed, i) for i, j in enumerate(jobs)]

        def done(j: Job, a: list[int]) -> None:
            out[j.tag] = a

        b = self.batcher(eos_ids)
        b.run(tagged, max_new_tokens, done)
        self.stats.append(b.stats.summary())
        return out  # type: ignore[return-value]

    # -- the interface of generate.generate_chunk / generate_dataset -------------------------------
    def generate_chunk(self, prompts: Sequence[Prompt], *, seed: int, sample_fraction: float,
                       sample_temperature: float, max_new_tokens: int, eos_ids: Sequence[int], **_: Any) -> SampleSet:
        chunk = _Chunk(0, prompts, seed, sample_fraction, sample_temperature, frozenset(eos_ids))
        b = self.batcher(eos_ids)
        b.run(_once(chunk.jobs), max_new_tokens, _on_done)
        self.stats.append(b.stats.summary())
        return chunk.result()

    def generate_dataset(self, prompts: Sequence[Prompt], data_dir: Path, *, chunk_prompts: int, token_budget: int,
                         seconds_budget: float | None, seed: int, progress: Callable[[str], None] = print,
                         sample_fraction: float, sample_temperature: float, max_new_tokens: int,
                         eos_ids: Sequence[int], **_: Any) -> SampleSet:
        """Shards of target answers until `token_budget` answer tokens (or `seconds_budget`) is reached.

        Budgets are checked when a chunk is admitted (as `generate.generate_dataset` checks them before a
        chunk): chunks already admitted finish, so the last shard is whole. Existing shards are reused."""
        data_dir.mkdir(parents=True, exist_ok=True)
        eos = frozenset(int(e) for e in eos_ids)
        starts = list(range(0, len(prompts), chunk_prompts))
        shards: dict[int, SampleSet] = {}
        state = {"next": 0, "tokens": 0, "generated": 0, "admitted": 0}
        t0 = time.perf_counter()

        def source() -> list[Job] | None:
            while state["next"] < len(starts):
                c = state["next"]
                if state["tokens"] + state["generated"] >= token_budget:
                    return None
                path = data_dir / f"shard_{c:05d}.npz"
                if path.exists():
                    s = SampleSet.load(path)
                    shards[c] = s
                    state["tokens"] += s.response_tokens
                    state["next"] += 1
                    continue
                if seconds_budget is not None and time.perf_counter() - t0 >= seconds_budget:
                    return None
                state["next"] += 1
                state["admitted"] += 1
                start = starts[c]
                chunk = _Chunk(c, prompts[start : start + chunk_prompts], seed + c, sample_fraction,
                               sample_temperature, eos, descending=c % 2 == 1)
                return chunk.jobs
            return None

        def on_done(job: Job, answer: list[int]) -> list[Job] | None:
            chunk, i, turn = job.tag
            state["generated"] += len(answer)
            nxt = chunk.done(i, turn, answer)
            if nxt is not None:
                return [nxt]
            if chunk.outstanding == 0:
                s = chunk.result()
                s.save(data_dir / f"shard_{chunk.index:05d}.npz")
                shards[chunk.index] = s
                dt = time.perf_counter() - t0
                st = b.stats
                progress(f"data shard {chunk.index}: {len(s)} samples, {s.response_tokens} answer tokens; "
                         f"{state['generated']} generated in {dt:.1f} s "
                         f"({state['generated'] / max(dt, 1e-9):.0f} tok/s, "
                         f"{1000 * st.decode_s / max(st.steps, 1):.2f} ms/step, occupancy "
                         f"{st.decode_tokens / max(st.row_steps, 1):.2f}, prefill {st.prefill_s:.1f} s)")
            return None

        b = self.batcher(eos_ids)
        b.run(source, max_new_tokens, on_done)
        self.stats.append(b.stats.summary())
        if not shards:
            raise RuntimeError("no distillation data: the prompt list is empty or the budget is zero")
        # The shards a rerun would load (generate.generate_dataset's rule: in order, until the token budget is
        # reached): chunks admitted while earlier ones were still in flight may overshoot it.
        keep, tokens = [], 0
        for c in sorted(shards):
            if tokens >= token_budget:
                break
            keep.append(shards[c])
            tokens += shards[c].response_tokens
        return SampleSet.concat(keep)


def _once(jobs: list[Job]) -> Callable[[], list[Job] | None]:
    box = [jobs]
    return lambda: box.pop() if box else None


def _on_done(job: Job, answer: list[int]) -> list[Job] | None:
    chunk, i, turn = job.tag
    nxt = chunk.done(i, turn, answer)
    return [nxt] if nxt is not None else None
