"""A measurement drafter with a known acceptance rate, for model shapes that have no trained drafter here.

`SyntheticDrafter` (drafter word `synthetic:ALPHA:SHAPE:RECORDING`) proposes the target's own greedy
continuation, recorded beforehand from a target-only run of the same prompts (a `Recording`), with each
position kept with probability ALPHA and replaced by a different token otherwise. The keep/replace decision of
each position is a pure function of the prompt and the position (`pipeline.rng`), so a run replays exactly.
Every propose call also runs the real forwards of a draft model of the given SHAPE (random weights, a name of
`pipeline.models.shapes.SHAPES` or a model folder) on its device, with its own KV cache, catch-up and top-k
sampling, exactly as `ModelDrafter` does: a step costs what a real drafter of that shape costs. SHAPE `self`
(`SyntheticSelfDrafter`) spends the time of self-speculation instead: the target's own forwards through a
StreamingLLM window of its cache (`pipeline.self_spec`, window 512 and 4 sinks), for long-context step costs.

Verification stays the target's own: drafts travel as point masses (no probabilities, like prompt lookup), so
greedy output is the target's greedy output and sampled output follows the target's distribution whatever this
drafter proposes. For greedy requests each drafted position is accepted with probability ALPHA, independently,
so a pass emits (1 - ALPHA^(K+1)) / (1 - ALPHA) tokens in expectation. Figures measured with it are labelled
"synthetic acceptance".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from pipeline.config import parse_synthetic
from pipeline.drafters import ModelDrafter, ProposeRow, _padded
from pipeline.models.base import CausalLM
from pipeline.rejection import DraftBlock
from pipeline.rng import Stream, uniform
from pipeline.self_spec import SelfSpecDrafter


@dataclass
class Recording:
    """The target's greedy continuations of a set of prompts (token ids), and its vocabulary size."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    vocab_size: int

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"vocab_size": self.vocab_size,
                                          "records": [{"prompt": p, "output": o}
                                                      for p, o in zip(self.prompts, self.outputs)]}))

    @classmethod
    def load(cls, path: str | Path) -> "Recording":
        try:
            data = json.loads(Path(path).read_text())
            records = data["records"]
            return cls([list(r["prompt"]) for r in records], [list(r["output"]) for r in records],
                       int(data["vocab_size"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"not a synthetic-drafter recording: {path}: {err}") from None


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens a greedy pass emits in expectation when each of K drafted positions is accepted with probability
    alpha independently (accepted prefix + the target's token): sum_{i=0..K} alpha^i."""
    return float(sum(alpha**i for i in range(k + 1)))


def _prompt_key(prompt: Sequence[int]) -> int:
    """A 62-bit key of a prompt (the seed of its keep/replace decisions)."""
    digest = hashlib.blake2b(json.dumps(list(prompt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


def synthetic_proposals(prompt: Sequence[int], output: Sequence[int], alpha: float, vocab_size: int) -> list[int]:
    """Per output position: the recorded token (probability alpha) or a different token. Pure in its inputs."""
    n = len(output)
    if n == 0:
        return []
    seeds = torch.full((n,), _prompt_key(prompt), dtype=torch.int64)
    u = uniform(seeds, torch.arange(n, dtype=torch.int64), Stream.DRAFT, 2)  # [n, 2]
    keep = (u[:, 0] < alpha).tolist()
    shift = (1 + (u[:, 1] * (vocab_size - 1)).long().clamp(max=vocab_size - 2)).tolist()  # 1..V-1: never 0
    return [t if k else (t + s) % vocab_size for t, k, s in zip(output, keep, shift)]


class _SyntheticProposals:
    """What a synthetic drafter proposes (the recorded continuation, each position kept with probability `alpha`),
    mixed into a drafter class whose `propose` does the real work whose time it spends."""

    alpha: float

    def _init_synthetic(self, recording: Recording | str | Path, alpha: float) -> None:
        """recording: the recording, or its file, read when the first proposal needs it (so a server can start
        before the target-only run that writes it)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"synthetic drafter: alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self._recording: Recording | None = None
        self._recording_path = None if isinstance(recording, Recording) else Path(recording)
        if isinstance(recording, Recording):
            self._use(recording)

    @property
    def recording(self) -> Recording:
        if self._recording is None:
            self._use(Recording.load(self._recording_path))
        return self._recording

    def _use(self, recording: Recording) -> None:
        if self.model.info.vocab_size < recording.vocab_size:
            raise ValueError(f"synthetic drafter: the draft shape's vocabulary ({self.model.info.vocab_size}) must "
                             f"cover the target's ({recording.vocab_size}): it is fed the target's tokens")
        self._proposals = [synthetic_proposals(p, o, self.alpha, recording.vocab_size)
                           for p, o in zip(recording.prompts, recording.outputs)]
        self._by_prompt: dict[int, dict[tuple[int, ...], int]] = {}  # prompt length -> prompt -> record index
        for i, p in enumerate(recording.prompts):
            self._by_prompt.setdefault(len(p), {})[tuple(p)] = i
        self._match: dict[str, tuple[int, int] | None] = {}  # request id -> (record index, prompt length)
        self._recording = recording

    def _record_of(self, request_id: str, context: Sequence[int]) -> tuple[int, int] | None:
        """(record index, prompt length) of the recording whose prompt starts the context; None if none does."""
        self.recording  # noqa: B018 - read on first use
        if request_id not in self._match:
            found = None
            for length, table in self._by_prompt.items():
                if length <= len(context):
                    i = table.get(tuple(context[:length]))
                    if i is not None:
                        found = (i, length)
                        break
            self._match[request_id] = found
        return self._match[request_id]

    def synthetic(self, row: ProposeRow, k: int) -> list[int]:
        """The row's k proposals: the recorded continuation after its context, kept or replaced per position."""
        hit = self._record_of(row.request_id, row.context)
        n = len(row.context)
        if hit is None:  # not a recorded prompt: tokens the target will almost surely reject
            return [(int(row.context[-1]) + 1 + j) % self.recording.vocab_size for j in range(k)]
        i, plen = hit
        props = self._proposals[i]
        out = props[n - plen: n - plen + k]
        return out + [(int(row.context[-1]) + 1 + j) % self.recording.vocab_size for j in range(k - len(out))]

    def loop_overrides(self, states: Sequence, device: torch.device | str):  # -> pipeline.device_loop.Overrides
        """This drafter's proposals for a device loop over requests `states` (each with `request_id`, `context`):
        per row its recorded proposals and where they start (rows of no recorded prompt: never, so the loop proposes
        what `synthetic` does for them)."""
        from pipeline.device_loop import Overrides

        found = [self._record_of(s.request_id, s.context) for s in states]
        props = [self._proposals[h[0]] if h is not None else [] for h in found]
        width = self.model.max_len  # one shape per batch size: a device loop keeps its graph
        starts = [h[1] if h is not None else 1 << 40 for h in found]
        tokens = _padded([p[:width] for p in props], width).to(device)
        return Overrides(tokens, torch.tensor(starts, dtype=torch.int64, device=device), self.recording.vocab_size)

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        super().propose(rows, k, sampling, steps, draft_top_k)  # the real drafter's work; its tokens dropped
        drafts = [self.synthetic(r, k) for r in rows]
        for r, d in zip(rows, drafts):  # as if the model had fed these: its next catch-up is a real drafter's
            fed = self._fed[r.request_id]
            fed[len(r.context):] = d[: k - 1]
        num_draft = [r.num_draft for r in rows]
        return DraftBlock(_padded([d[:n] for d, n in zip(drafts, num_draft)], k),
                          torch.tensor(num_draft, dtype=torch.int64))

    def release(self, request_id: str) -> None:
        super().release(request_id)
        if self._recording is not None:
            self._match.pop(request_id, None)


class SyntheticDrafter(_SyntheticProposals, ModelDrafter):
    """Drafts the recorded continuation, each position kept with probability `alpha`; spends a real draft model's
    time (`model`, any `CausalLM`: its forwards run, its tokens are discarded)."""

    def __init__(self, model: CausalLM, recording: Recording | str | Path, alpha: float,
                 name: str | None = None) -> None:
        ModelDrafter.__init__(self, model, name or f"synthetic:{alpha}:{model.info.name}")
        self._init_synthetic(recording, alpha)

    @classmethod
    def from_spec(cls, spec: str, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> "SyntheticDrafter":
        """The drafter a `synthetic:ALPHA:SHAPE:RECORDING` word names, its draft model built on `device`."""
        s = parse_synthetic(spec)
        return cls(timing_model(s.shape, device, dtype, seed), s.recording, s.alpha, name=spec)


class SyntheticSelfDrafter(_SyntheticProposals, SelfSpecDrafter):
    """Drafts the recorded continuation, each position kept with probability `alpha`; spends the time of the
    target's own StreamingLLM drafts (`synthetic:ALPHA:self:RECORDING`: `SelfSpecDrafter`'s forwards through a
    window of the target's cache run, their tokens are discarded). For long-context shapes with no real acceptance
    here (random weights): the step costs are self-speculation's, the acceptance is set."""

    def __init__(self, target: CausalLM, recording: Recording | str | Path, alpha: float, window: int = 512,
                 sinks: int = 4, name: str | None = None) -> None:
        SelfSpecDrafter.__init__(self, target, window, sinks)
        self.name = name or f"synthetic:{alpha}:{self.name}"
        self._init_synthetic(recording, alpha)


def timing_model(shape: str, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> CausalLM:
    """The draft model whose forwards a synthetic drafter runs: a named shape with random weights, or a folder."""
    from pipeline.models.shapes import SHAPES, random_llama

    if shape in SHAPES:
        from pipeline.models.loader import parse_dtype

        return random_llama(shape, device, parse_dtype(dtype), seed=seed)
    from pipeline.models.loader import load_model

    return load_model(shape, device=device, dtype=dtype)[0]
