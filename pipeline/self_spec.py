"""Self-speculation for long contexts (MagicDec, Chen et al. 2024): the target drafts for itself with a
StreamingLLM cache (Xiao et al. 2023).

At long contexts and large batches a decode step's time goes to reading the KV cache, not the weights: 32 streams
of 8k tokens of an 8B Llama hold 34 GB of keys and values against 16 GB of weights. A draft step that reads only a
few attention-sink positions and a sliding window of the last W positions costs little more than the weights, so
the target itself, with that small view of its cache, becomes a drafter whose drafts the full target accepts often.

`SelfSpecDrafter` (drafter word `self` or `self:window=W,sinks=N`) runs the target's own runner, weights and cache
(nothing is copied or allocated): a draft forward passes `stream=(window, sinks)`, under which a query at
position p sees the keys at positions < sinks and in (p - window, p] of its own slot (pipeline.models.llama; the
graph path's Triton attention reads only those keys). Keys keep their original positions and RoPE, as MagicDec's
StreamingLLM drafter does; the keys it reads are the target's own, written by the target's prefill and verify
passes. The drafter feeds the pending token and its K-1 first drafts at the positions the verify pass feeds next,
which overwrites their keys and values with the target's: what the drafter writes is never read by the target.
So the drafts are verified by the full target as usual and the output stays exact (greedy: the target's tokens;
sampled: the target's distribution, the drafter shipping the sparse distribution it drew from, as
`ModelDrafter` does).

`LongContextDrafter` is the engine's automatic choice (`EngineConfig.self_spec_min_context`,
`self_spec_min_batch`; pipeline.engine): requests whose prompt reaches the threshold draft with the self drafter,
the others with the configured drafter. The choice is made once per request at admission from its prompt
length, so a seeded request replays exactly whatever shares its batch.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from pipeline.config import EngineConfig, SelfSpec
from pipeline.drafters import Drafter, ModelDrafter, ProposeRow
from pipeline.models.base import CausalLM
from pipeline.rejection import DraftBlock

log = logging.getLogger(__name__)


class _StreamingView:
    """The target runner seen through a StreamingLLM window: `forward` passes `stream=(window, sinks)`."""

    def __init__(self, target: CausalLM, window: int, sinks: int) -> None:
        self.target, self.stream = target, (window, sinks)
        self.info = target.info

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.target, "device", "cpu"))

    @property
    def num_slots(self) -> int:
        return self.target.num_slots

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                logits_from: int = 0) -> torch.Tensor:  # [B, T - logits_from, V] float32
        return self.target.forward(tokens, positions, slots, logits_from, stream=self.stream)


class SelfSpecDrafter(ModelDrafter):
    """The target drafting for itself through a StreamingLLM window of its own cache (module docstring).

    It drafts with `ModelDrafter`'s loop (sparse top-k distributions, seeded draws); what differs is the cache: the
    target's slot of each request (`assign_slot`, told by the engine at admission), holding every committed token
    already, so there is no prefill and no catch-up: a propose call feeds the pending token, then K-1 drafts."""

    def __init__(self, target: CausalLM, window: int = 512, sinks: int = 4) -> None:
        if not getattr(target, "supports_stream", False):
            raise ValueError(f"self-speculation runs the target with a streaming window: target {target.info.name} "
                             f"runs on {type(target).__name__}, which has none (it needs the Llama fast path)")
        if getattr(getattr(target, "args", None), "sliding_window", None) is not None:
            raise ValueError(f"self-speculation: target {target.info.name} has its own sliding window")
        super().__init__(_StreamingView(target, window, sinks), name=SelfSpec(window, sinks).word())
        self.window, self.sinks = window, sinks
        self._target_slots: dict[str, int] = {}

    def bind_target(self, target: CausalLM) -> None:
        """Draft through `target`, the runner the engine verifies with (its CUDA-graph wrapper of the same cache)."""
        self.model.target = target

    def assign_slot(self, request_id: str, slot: int) -> None:
        """The target's cache slot of a request (its committed tokens are there)."""
        self._target_slots[request_id] = slot

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        """Nothing to prefill: the target's prefill fills the cache this drafter reads."""

    def release(self, request_id: str) -> None:
        self._target_slots.pop(request_id, None)
        self._fed.pop(request_id, None)

    @torch.inference_mode()
    def feed_context(self, rows: Sequence[ProposeRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed each row's pending token (its last committed one, not yet in the cache) at its position through the
        window -> (logits [B, 1, V], slots [B], positions [B] where the first draft goes; both on the host)."""
        missing = [r.request_id for r in rows if r.request_id not in self._target_slots]
        if missing:
            raise RuntimeError(f"self-speculation: no target slot for requests {missing[:3]} (assign_slot first)")
        slots = torch.tensor([self._target_slots[r.request_id] for r in rows], dtype=torch.int64)
        lengths = [len(r.context) for r in rows]
        pending = torch.tensor([[r.context[n - 1]] for r, n in zip(rows, lengths)], dtype=torch.int64)
        for r in rows:
            self._fed[r.request_id] = []  # ModelDrafter's propose records its drafts here; nothing reads them
        positions = torch.tensor(lengths, dtype=torch.int64)
        logits = self.model.forward(pending.to(self.device), positions - 1, slots)  # [B, 1, V]
        return logits, slots, positions


class LongContextDrafter:
    """Per request: the self drafter for prompts of at least `min_context` tokens, `base` for the others (decided at
    admission, so a request keeps its drafter). One propose call drafts each group in one call and merges the
    blocks; a request that drafts with one of them never touches the other."""

    def __init__(self, base: Drafter, self_drafter: SelfSpecDrafter, min_context: int) -> None:
        self.base, self.self_drafter, self.min_context = base, self_drafter, min_context
        self.name = f"{base.name}|{self_drafter.name}>={min_context}"
        self._long: set[str] = set()

    def bind_target(self, target: CausalLM) -> None:
        self.self_drafter.bind_target(target)

    def assign_slot(self, request_id: str, slot: int) -> None:
        self.self_drafter.assign_slot(request_id, slot)

    def admit(self, request_id: str, context: Sequence[int]) -> None:
        if len(context) >= self.min_context:
            self._long.add(request_id)
            self.self_drafter.admit(request_id, context)
        else:
            self._long.discard(request_id)
            self.base.admit(request_id, context)

    def release(self, request_id: str) -> None:
        self._part(request_id).release(request_id)
        self._long.discard(request_id)
        self.self_drafter.release(request_id)

    def finish(self, request_id: str, output_ids: Sequence[int]) -> None:
        """`pipeline.step.retire`: a base drafter that learns from outputs (suffix decoding) learns the short ones."""
        finish = getattr(self.base, "finish", None)
        if request_id not in self._long and finish is not None:
            finish(request_id, output_ids)
        self.release(request_id)

    def prepare(self, rows: Sequence[ProposeRow]) -> None:
        prepare = getattr(self.base, "prepare", None)
        short = [r for r in rows if r.request_id not in self._long]
        if prepare is not None and short:
            prepare(short)

    def _part(self, request_id: str) -> Drafter:
        return self.self_drafter if request_id in self._long else self.base

    def propose(self, rows, k, sampling, steps, draft_top_k) -> DraftBlock:
        long = [b for b, r in enumerate(rows) if r.request_id in self._long]
        if len(long) == len(rows):
            return self.self_drafter.propose(rows, k, sampling, steps, draft_top_k)
        if not long:
            return self.base.propose(rows, k, sampling, steps, draft_top_k)
        short = [b for b, r in enumerate(rows) if r.request_id not in self._long]
        blocks = []
        for part, idx in ((self.self_drafter, long), (self.base, short)):
            if any(rows[b].num_draft for b in idx):
                index = torch.tensor(idx, dtype=torch.int64)
                blocks.append((idx, part.propose([rows[b] for b in idx], k, sampling.select(idx),
                                                 steps[index.to(steps.device)], draft_top_k).to("cpu")))
        return merge_blocks(len(rows), k, draft_top_k, blocks)


def merge_blocks(batch: int, k: int, top_k: int, parts: list[tuple[list[int], DraftBlock]]) -> DraftBlock:
    """One host-side block of `batch` rows from blocks of row subsets (rows in no part draft nothing). A part
    without probabilities (point masses) ships each token as a point mass; narrower supports are padded with a
    repeated id at probability 0."""
    tokens = torch.zeros(batch, k, dtype=torch.int64)
    counts = torch.zeros(batch, dtype=torch.int64)
    top_ids = torch.zeros(batch, k, top_k, dtype=torch.int64)
    top_probs = torch.zeros(batch, k, top_k, dtype=torch.float32)
    for rows, block in parts:
        idx = torch.tensor(rows, dtype=torch.int64)
        width = block.token_ids.shape[1]
        tokens[idx, :width], counts[idx] = block.token_ids, block.num_draft
        if block.top_ids is None:  # point masses
            top_ids[idx, :width] = block.token_ids[:, :, None].expand(-1, -1, top_k)
            top_probs[idx, :width, 0] = (torch.arange(width)[None, :] < block.num_draft[:, None]).float()
        else:
            n = block.top_ids.shape[-1]
            top_ids[idx, :width, :n], top_probs[idx, :width, :n] = block.top_ids, block.top_probs
            top_ids[idx, :width, n:] = block.top_ids[..., :1]
    return DraftBlock(tokens, counts, top_ids, top_probs)


def auto_self_spec(drafter: Drafter | None, target: CausalLM, config: EngineConfig) -> Drafter | None:
    """The engine's automatic choice: `drafter` for short prompts and the self drafter for prompts of at least
    `config.self_spec_min_context` tokens, where the engine holds a large batch on a GPU (a CUDA target on a path
    with streaming windows, `max_batch_size >= self_spec_min_batch`, `max_seq_len` reaching the threshold); logged
    in one line. `drafter` unchanged otherwise (no speculation asked for, already self-speculating, a token tree)."""
    n = config.self_spec_min_context
    device = torch.device(getattr(target, "device", "cpu"))
    if (drafter is None or n <= 0 or isinstance(drafter, (SelfSpecDrafter, LongContextDrafter))
            or config.tree is not None or device.type != "cuda" or not getattr(target, "supports_stream", False)
            or getattr(getattr(target, "args", None), "sliding_window", None) is not None
            or config.max_batch_size < config.self_spec_min_batch or config.max_seq_len < n):
        return drafter
    self_drafter = SelfSpecDrafter(target, config.self_spec_window, config.self_spec_sinks)
    log.info("long contexts: prompts of >= %d tokens draft with %s (max_batch_size %d >= %d on %s: the KV cache, "
             "not the weights, dominates a step); shorter ones with %s", n, self_drafter.name, config.max_batch_size,
             config.self_spec_min_batch, device, drafter.name)
    return LongContextDrafter(drafter, self_drafter, n)
