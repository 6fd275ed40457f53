"""Per-request state: committed tokens, step counter, stopping, incremental text, statistics.

Everything here is plain Python data and serialises to a dict (`to_dict` / `from_dict`), so the serving
layer can persist a request after every step and another process can resume it exactly.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any, Sequence

from pipeline.config import SamplingParams


class TokenView(Sequence[int]):
    """`head + tail` as a read-only sequence over the two lists themselves (no copy; later appends show).
    Slices are lists."""

    __slots__ = ("_head", "_tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self._head, self._tail = head, tail

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __getitem__(self, i):  # int -> token; slice -> list
        head, tail = self._head, self._tail
        n_head = len(head)
        if isinstance(i, slice):
            start, stop, step = i.indices(n_head + len(tail))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            if stop <= start:
                return []
            if stop <= n_head:
                return head[start:stop]
            if start >= n_head:
                return tail[start - n_head:stop - n_head]
            if start == 0 and stop == n_head + len(tail):
                return head + tail  # the whole: one copy
            return head[start:] + tail[:stop - n_head]
        if i < 0:
            i += n_head + len(tail)
        if not 0 <= i < n_head + len(tail):
            raise IndexError("token index out of range")
        return head[i] if i < n_head else tail[i - n_head]

    def __iter__(self):
        return chain(self._head, self._tail)

    def __repr__(self) -> str:
        return f"TokenView({list(self)!r})"


@dataclass
class RequestStats:
    """Speculation statistics of one request."""

    drafted: int = 0  # draft tokens proposed (sum of num_draft over passes)
    accepted: int = 0  # draft tokens accepted
    target_passes: int = 0  # target forward passes (steps)
    generated: int = 0  # tokens emitted (accepted + recovered + bonus, after stop truncation)
    drafted_at: list[int] = field(default_factory=list)  # [K] proposals per draft position
    accepted_at: list[int] = field(default_factory=list)  # [K] acceptances per draft position
    start_time: float = 0.0  # time.time() at admission
    first_token_time: float | None = None
    end_time: float | None = None

    def record_pass(self, num_draft: int, num_accepted: int) -> None:
        self.target_passes += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        if len(self.drafted_at) < num_draft:
            grow = num_draft - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_draft):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < num_accepted)

    def summary(self) -> dict[str, Any]:
        end = self.end_time or time.time()
        wall = max(end - self.start_time, 1e-9)
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_passes": self.target_passes,
            "generated": self.generated,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # accepted + recovered/bonus per pass, i.e. tokens per target pass (bonus included)
            "mean_accepted_tokens": (self.accepted + self.target_passes) / self.target_passes
            if self.target_passes
            else 0.0,
            "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "drafted_at": list(self.drafted_at),  # the counts behind it: drafts verified at each position
            "accepted_at": list(self.accepted_at),
            "wall_time_s": wall,
            "time_to_first_token_s": None if self.first_token_time is None else self.first_token_time - self.start_time,
            "tokens_per_s": self.generated / wall,
        }


class IncrementalDetokenizer:
    """Text deltas from a growing list of ids, robust to multi-token characters (TGI/vLLM offsets scheme)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])  # a little prompt context for leading spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


@dataclass
class RequestState:
    """Committed state of one request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # seed fixed
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    step: int = 0  # target passes so far: the randomness key of the next pass
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self) -> None:
        assert self.params.seed is not None, "fix the seed first (SamplingParams.with_seed())"
        if not self.stats.start_time:
            self.stats.start_time = time.time()
        self._detok: IncrementalDetokenizer | None = None
        self._emitted_chars = 0  # text already handed out (stop-string hold-back)

    # -- views -------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids  # a copy: O(length)

    @property
    def context_view(self) -> "TokenView":
        """The context without a copy (O(1)): a live read-only view, for a step's own reads before it commits
        (building `context` for every row of every step costs O(length): about 2.4 us a row at 2k tokens,
        `python -m ops.bench_host_step`)."""
        return TokenView(self.prompt_ids, self.output_ids)

    @property
    def length(self) -> int:
        """len(context), without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """context[-1], without building it."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def text(self) -> str:
        return self._text_until_stop()

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """Enable text output and stop strings; replays already committed tokens."""
        self._detok = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        for t in self.output_ids:
            if self.params.ignore_eos or t not in self.eos_token_ids:
                self._detok.push(t)

    # -- the one mutation --------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int], num_draft: int, num_accepted: int) -> tuple[list[int], str]:
        """Append one pass's emitted tokens, stopping at EOS, a stop string or max_tokens.

        Returns (token ids committed now, text that is now safe to stream).
        """
        assert not self.finished, f"request {self.request_id} already finished ({self.finish_reason})"
        self.step += 1
        self.stats.record_pass(num_draft, num_accepted)
        committed: list[int] = []
        for tok in tokens:
            committed.append(tok)
            self.output_ids.append(tok)
            is_eos = tok in self.eos_token_ids and not self.params.ignore_eos
            if self._detok is not None and not is_eos:  # EOS is never text
                self._detok.push(tok)
            if is_eos:
                self.finish_reason = "stop"
            elif self._stop_string_hit():
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                break
        self.stats.generated = len(self.output_ids)
        if committed and self.stats.first_token_time is None:
            self.stats.first_token_time = time.time()
        if self.finished:
            self.stats.end_time = time.time()
        return committed, self._safe_text_delta()

    def abort(self) -> None:
        self.finish_reason = self.finish_reason or "abort"
        self.stats.end_time = time.time()

    # -- stop strings --------------------------------------------------------------------------------
    def _stop_string_hit(self) -> bool:
        if not self.params.stop or self._detok is None:
            return False
        text = self._detok.text
        return any(s in text for s in self.params.stop)

    def _text_until_stop(self) -> str:
        if self._detok is None:
            return ""
        text = self._detok.text
        cut = min((text.find(s) for s in self.params.stop if s in text), default=len(text))
        return text[:cut]

    def _safe_text_delta(self) -> str:
        """New text, holding back a tail that could still grow into a stop string."""
        text = self._text_until_stop()
        safe = len(text)
        if not self.finished:
            for s in self.params.stop:
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        safe = min(safe, len(text) - n)
                        break
        delta = text[self._emitted_chars : safe] if safe > self._emitted_chars else ""
        self._emitted_chars = max(self._emitted_chars, safe)
        return delta

    # -- persistence ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_ids": self.prompt_ids,
            "params": {**asdict(self.params), "stop": list(self.params.stop)},
            "eos_token_ids": list(self.eos_token_ids),
            "output_ids": self.output_ids,
            "step": self.step,
            "finish_reason": self.finish_reason,
            "stats": asdict(self.stats),
            "emitted_chars": self._emitted_chars,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], tokenizer: Any | None = None) -> "RequestState":
        seq = cls(
            request_id=d["request_id"],
            prompt_ids=list(d["prompt_ids"]),
            params=SamplingParams(**{**d["params"], "stop": tuple(d["params"]["stop"])}),
            eos_token_ids=tuple(d["eos_token_ids"]),
            output_ids=list(d["output_ids"]),
            step=int(d["step"]),
            finish_reason=d["finish_reason"],
            stats=RequestStats(**d["stats"]),
        )
        if tokenizer is not None:
            seq.attach_tokenizer(tokenizer)
        seq._emitted_chars = int(d.get("emitted_chars", 0))
        return seq

