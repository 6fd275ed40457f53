"""The typed messages that cross the Ray hops: ingress -> coordinator -> drafter and target workers.

Sampling fields are validated once, at the HTTP edge (`deployments.protocol` -> `SamplingParams`); the
`SamplingParams` and `SpecParams` objects themselves travel on, and nobody downstream rebuilds them from dicts.
A row's draft travels as `pipeline.step.Draft` (a drafter worker's answer, inside a `VerifyCall`; a token tree as its
nodes, their parents and each node's sparse distribution), a target pass's outcome per row as `pipeline.step.Verdict`
(a target worker's answer).
Redis keeps JSON: `spec_to_json` / `spec_from_json` are its one conversion of the speculation settings (a request's
state goes through `RequestState.to_dict` / `from_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import numpy as np
import torch

from pipeline.config import SamplingParams, SpecParams
from pipeline.step import Draft, Verdict, row_budget

PREFILL_CHUNK = 256  # prompt tokens one request prefills per target pass (deployments.target_replica)


@dataclass
class GenerateRequest:
    """A new request, from the ingress to a coordinator."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str  # the served model name (stored for resumed streams)
    created: int  # unix seconds
    prompt_ids: list[int]
    params: SamplingParams  # validated, seed fixed
    spec: SpecParams
    trace: Optional[dict] = None  # W3C context of the ingress span (deployments.tracing)


@dataclass
class HeadFeatures:
    """The target's hidden states that a feature head on a drafter replica reads, for committed positions
    start..start+n-1 (`drafter.head_placement: drafter`): a target worker's verdict carries those of the pending token
    and the accepted drafts (and, after a prefill, of the whole prefix first), the next `ProposeCall` takes them to
    the drafter. EAGLE-3: the three auxiliary layers' states concatenated; Medusa: the final normed state. The raw
    bits of the target's dtype travel as a numpy array (a bfloat16 row of an 8B model's three states: 24 KB)."""

    start: int
    states: np.ndarray  # [n, F] in the target's dtype (16-bit types as int16 bit patterns)
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16"

    @classmethod
    def of(cls, start: int, states: torch.Tensor) -> "HeadFeatures":
        t = states.detach().to("cpu").contiguous()
        raw = t.view(torch.int16) if t.element_size() == 2 else t
        return cls(start, raw.numpy().copy(), str(t.dtype).removeprefix("torch."))

    @property
    def length(self) -> int:
        return int(self.states.shape[0])

    def tensor(self) -> torch.Tensor:  # [n, F]
        t = torch.from_numpy(self.states)
        dtype = getattr(torch, self.dtype)
        return t.view(dtype) if t.dtype != dtype else t

    def then(self, later: "HeadFeatures") -> "HeadFeatures":
        """These states followed by `later`'s (which replace any they overlap: the request was rewound)."""
        keep = later.start - self.start
        if keep < 0:
            return later
        assert keep <= self.length, f"a gap in the head's features: {self.start}+{self.length} < {later.start}"
        return HeadFeatures(self.start, np.concatenate([self.states[:keep], later.states]), self.dtype)


@dataclass
class ProposeCall:
    """A coordinator asking a drafter worker for one request's drafts (the worker mirrors the context)."""

    request_id: str
    base: int  # context length the worker already mirrors for this request
    new: list[int]  # context[base:]
    num_draft: int  # tokens wanted (may exceed K by one: the guess of the bonus token, for overlap)
    params: SamplingParams  # seed fixed
    step: int  # the target pass these drafts are for (randomness key)
    draft_top_k: int
    epoch: int = 1  # the caller's ownership epoch of the request (workers refuse older ones: `EpochFence`)
    features: Optional[HeadFeatures] = None  # a feature head's input not yet sent (head on the drafter replica)
    tree: bool = False  # draft a token tree of the worker's shape (`drafter.tree`), num_draft capping its depth


@dataclass
class PrespecCall:
    """A coordinator asking a drafter worker, while step `step - 1` is verified, for step `step`'s drafts under each
    likely outcome (`pipeline.prespec`): the context `context[:base] + new` (committed tokens only) plus a tail."""

    request_id: str
    base: int  # context length the worker already mirrors for this request
    new: list[int]  # committed context[base:]
    tails: list[list[int]]  # per branch: the accepted drafts, then the guessed recovered or bonus token
    num_draft: list[int]  # per branch: tokens wanted (K, plus one: the guess for the branches of the step after)
    params: SamplingParams  # seed fixed
    step: int  # the target pass these drafts are for (randomness key)
    draft_top_k: int
    epoch: int = 1  # the caller's ownership epoch of the request (`EpochFence`)


@dataclass
class VerifyCall:
    """One request's part of a target pass: what crosses the network is ids and sparse probabilities."""

    request_id: str
    start: int  # absolute position of the pending token
    pending: int  # the last committed token (not yet in the target's cache)
    draft: Draft
    params: SamplingParams  # seed fixed
    step: int  # the request's target-pass counter (randomness key)
    prefix: Optional[list[int]] = None  # committed tokens [0, start) when the cache may lack them
    epoch: int = 1  # the caller's ownership epoch of the request (workers refuse older ones: `EpochFence`)
    head_draft: int = 0  # tokens the target worker's own feature head drafts for this pass (`draft` is then empty)
    draft_top_k: int = 0  # with head_draft: the sparse draft distribution's width
    # A multi-step call (`TargetWorker.verify_steps`): the worker runs up to `steps` passes, making each next call
    # from the last verdict itself; it stops early once the request has emitted `remaining` tokens or a stop id.
    steps: int = 1
    head_k: int = 0  # K of the worker's head for the passes after the first (each capped by what remains)
    remaining: int = 0  # tokens the request may still emit (max_tokens minus its output so far)
    stop_ids: tuple[int, ...] = ()  # token ids that end the request (EOS, unless it ignores EOS)

    def after(self, verdict: Verdict) -> "VerifyCall":
        """The call of this request's next pass once `verdict`, this pass's outcome, is committed: its last emitted
        token is the next pending one, everything before it is in the worker's cache."""
        remaining = self.remaining - len(verdict.tokens)
        return replace(self, start=self.start + len(verdict.tokens), pending=verdict.tokens[-1], draft=Draft([]),
                       step=self.step + 1, prefix=None, head_draft=row_budget(self.head_k, remaining),
                       remaining=remaining, steps=self.steps - 1)

    def ends_with(self, verdict: Verdict) -> bool:
        """Whether `verdict` ends the request (as far as the worker can tell: the coordinator also stops at stop
        strings) or this call's passes."""
        return (self.steps <= 1 or self.remaining - len(verdict.tokens) <= 0
                or any(t in self.stop_ids for t in verdict.tokens))

    @property
    def cost(self) -> int:
        """Tokens this call feeds (StepBatcher bounds prefills per pass with it)."""
        drafts = len(self.draft.tokens) + self.head_draft
        return 1 + drafts + (min(len(self.prefix), PREFILL_CHUNK) if self.prefix else 0)


@dataclass
class StepEvent:
    """One step of a request, from a coordinator to the ingress (and, as JSON, into Redis for resumed streams)."""

    i: int  # the step's index (the request's target pass): dedup and resume key
    ids: list[int]  # token ids committed by the step
    text: str  # text now safe to stream (stop strings held back)
    finish: Optional[str]  # "stop" | "length" on the last step
    usage: Optional[dict[str, int]] = None  # on the last step: prompt_tokens, completion_tokens
    speculation: Optional[dict[str, Any]] = None  # on the last step: the request's speculation statistics

    def to_json(self) -> dict[str, Any]:
        d = {"i": self.i, "ids": self.ids, "text": self.text, "finish": self.finish}
        if self.usage is not None:
            d["usage"] = self.usage
        if self.speculation is not None:
            d["speculation"] = self.speculation
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StepEvent":
        return cls(d["i"], d["ids"], d["text"], d.get("finish"), d.get("usage"), d.get("speculation"))


@dataclass
class ErrorEvent:
    """A request's error, streamed as data (the ingress tells it from a lost coordinator)."""

    error: dict[str, Any]  # the OpenAI error body's "error": message, type, param, code
    status: int  # HTTP status


def spec_to_json(spec: SpecParams) -> dict[str, Any]:
    return asdict(spec)


def spec_from_json(d: dict[str, Any]) -> SpecParams:
    return SpecParams(**d)
