"""Target replicas: a Serve host plus a worker actor that holds the target model and its KV-cache slots.

The worker runs the target side of the step (`pipeline.step.verify_and_accept`: one pass over the rows' drafts,
verification and acceptance) and returns each request's `Verdict`: the tokens it emits. Concurrent requests'
calls are batched into one target pass (`StepBatcher`).

Cache protocol, per request: a call feeds `[pending] + draft` at absolute position `start`; the worker's
cache must hold the request's committed tokens at positions [0, start). It knows it does when it fed this
request up to at least `start` before (rejected tokens beyond are simply overwritten: rollback is free).
Otherwise the call must carry `prefix` (the committed tokens [0, start)), which the worker prefills first;
without it the answer is CACHE_MISS and the coordinator resends with the prefix (replica restarted, or request
moved after a failure).

Slots (deployments.admission): a request acquires one (`admit`) before its first step and keeps it until it is
released; requests beyond the slots wait in a bounded FIFO queue, they never evict a running request. Only a pass
that runs out of memory preempts one (the youngest request in it): its call is answered PREEMPTED, and the
coordinator queues it again.

Prefill is chunked: a prefix is fed PREFILL_CHUNK tokens per target pass (the row goes back into the queue
until done, then verifies in the same pass as its last chunk), so a long prompt does not stall the decode
steps of the requests already running on the replica.

Feature heads (`drafter.head_placement`, `pipeline.heads.drafter.HeadDrafter`):
- 'target': the worker holds the head. A call asks for `head_draft` tokens; the pass drafts them with the head
  (`pipeline.step.propose`), verifies them and lets the head read the target's states of the newly committed
  positions, as the engine's step does. The head's cache slot lives and dies with the request's target slot: a
  prefill (the first call, or a resend with `prefix` after a restart or a miss) lets it read the prefix afresh, and
  a call whose head has not read exactly the committed positions [0, start) is answered CACHE_MISS. With
  `drafter.tree` the head drafts token trees and the same pass verifies them with the target's tree attention
  (the cache keeps the accepted path); a verdict is a chain's (its tokens, and the tree's depth as `num_draft`).
- 'drafter': each verdict carries the states a head on a drafter replica reads (`messages.HeadFeatures`): those of
  the pending token and the accepted drafts, after a prefill those of the prefix first.

Token trees of a draft model (`drafter.tree`): a call's `draft` is then a tree (its nodes with their parents), which
`pipeline.step.pack` stacks with the pass's other rows and `verify_and_accept` verifies with the target's tree
attention and compacts to the accepted path, as for a head's trees; `info` says whether this worker's runner can
(`supports_tree`: not a tensor-parallel group, not the generic runner).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Optional, Sequence

import torch

from deployments import metrics, tracing
from deployments.admission import PREEMPTED, QUEUE_FULL, QueueFull, SlotQueue
from deployments.batching import AGAIN, StepBatcher
from deployments.config import TARGET, AppConfig
from deployments.messages import PREFILL_CHUNK, HeadFeatures, VerifyCall
from deployments.tp_group import leader_runner, spawn_tensor_parallel_workers
from deployments.workers import CACHE_MISS, STALE, EpochFence, ModelHost, kv_slots, spawn_workers, warm_up
from pipeline.config import TreeConfig
from pipeline.drafters import HybridDrafter, PromptLookupDrafter, ProposeRow, build_drafter
from pipeline.heads.drafter import HeadDrafter
from pipeline.models.graphs import graphs_on_cuda
from pipeline.models.loader import load_model
from pipeline.sampling import SamplingTensors
from pipeline.step import CACHE_SLACK, Verdict, catch_up, pack, propose, verify_and_accept
from pipeline.tree import supports_tree

logger = logging.getLogger(__name__)

PREFILL_TOKEN_BUDGET = 512  # prompt tokens prefilled per target pass beyond the first prefill


class TargetWorker:
    """Holds one target model (one tensor-parallel rank) and serves batched verify calls."""

    def __init__(
        self, model: Optional[str], max_batch_size: int, max_seq_len: int, device: str = "cpu",
        dtype: str = "float32", torch_threads: int = 1, batch_wait_ms: float = 1.0,
        rank: int = 0, world_size: int = 1, tp_init_method: Optional[str] = None, tp_allreduce: str = "auto",
        kv_cache_gb: Optional[float] = None, kv_cache_fraction: float = 0.9, max_waiting: int = 64,
        head: Optional[str] = None,  # a feature head ('eagle3:DIR', 'medusa:DIR') that reads this target's states
        head_in_target: bool = True,  # run it here (else return the states it reads with each verdict)
        tree: Optional[TreeConfig] = None,  # the head here drafts token trees of this shape (`HeadDrafter.draft_trees`)
    ) -> None:
        assert rank == 0, "ranks > 0 of a tensor-parallel replica are tp_group.RankFollower actors"
        torch.set_num_threads(torch_threads)
        if world_size > 1:  # rank 0 of a tensor-parallel group: each pass is broadcast to the other ranks
            self.model = leader_runner(model, world_size, tp_init_method, device, dtype, allreduce=tp_allreduce)
        else:
            # CUDA: the static-shape graph runner (as the engine and tensor-parallel ranks use); CPU unchanged.
            self.model = graphs_on_cuda(load_model(model, device=device, dtype=dtype)[0])
        max_seq_len = min(max_seq_len, self.model.info.max_position_embeddings or max_seq_len)
        self.max_seq_len = max_seq_len
        num_slots = kv_slots(self.model, device, kv_cache_gb, kv_cache_fraction, max_seq_len + CACHE_SLACK,
                             max_batch_size, "target")
        self.model.allocate(num_slots, max_seq_len + CACHE_SLACK)
        warm_up(self.model, num_slots, "target")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.head: Optional[HeadDrafter] = None  # the feature head this worker runs (head_in_target)
        self.drafter: Any = None  # what drafts here: the head, or prompt lookup before it (`HybridDrafter`)
        self._lookup: Optional[PromptLookupDrafter] = None  # that prompt lookup, which reads `_ctx`
        self._ctx: dict[str, list[int]] = {}  # with a lookup: request id -> its committed tokens (pending last)
        self.feature_layers: tuple[int, ...] = ()  # the states a pass computes for a head, here or elsewhere
        if head is not None:
            drafter = build_drafter(head, self.model.info, None, target=self.model)
            hd = drafter.model if isinstance(drafter, HybridDrafter) else drafter
            self.feature_layers = hd.feature_layers
            if head_in_target:
                hd.allocate(num_slots, max_seq_len + CACHE_SLACK)
                self.head, self.drafter = hd, drafter
                if tree is not None and supports_tree(self.model):
                    hd.draft_trees(tree)
                elif tree is not None:
                    logger.warning("token trees: the target runs on %s, which has no tree attention; drafting chains "
                                "instead", type(self.model).__name__)
                self._lookup = drafter.lookup if isinstance(drafter, HybridDrafter) else None
            if world_size == 1:
                warm_up(self.model, num_slots, "target (head's states)", self.feature_layers)
        self._head_read: dict[str, int] = {}  # request id -> committed positions [0, n) its head has read
        self._prefix_features: dict[str, list[torch.Tensor]] = {}  # request id -> states of a prefill in progress
        self._fed: dict[str, int] = {}  # request id -> positions [0, fed) written by its calls in its slot
        self._prefilling: dict[str, int] = {}  # request id -> prompt tokens prefilled so far (chunked)
        self.epochs = EpochFence()  # calls of a coordinator that lost the request are refused (STALE)
        self.slots = SlotQueue(num_slots, max_waiting, on_free=self._drop_cache,
                               on_queue=lambda n: metrics.set_admission_queue(n, TARGET.lower()))
        self.batcher = StepBatcher(self._run_batch, num_slots, batch_wait_ms, name="target",
                                   token_budget=PREFILL_TOKEN_BUDGET)
        self.compute_s = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- calls -------------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        i = self.model.info
        return {"name": i.name, "path": i.path, "vocab_size": i.vocab_size, "eos_token_ids": list(i.eos_token_ids),
                "max_seq_len": self.max_seq_len, "num_slots": self.num_slots,
                "supports_tree": supports_tree(self.model)}  # verifies token trees (`drafter.tree`)

    async def ping(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batcher.batches, "rows": self.batcher.rows, "compute_s": self.compute_s,
                "slots_used": len(self.slots.holders), "slots": self.slots.capacity, "waiting": self.slots.waiting,
                "preempted": self.slots.preempted, "active_requests": self.batcher.active() + self.slots.waiting}

    async def admit(self, request_id: str, bounded: bool = True) -> float | str:
        """Take a KV-cache slot for the request, waiting in FIFO order while all are held. -> seconds waited, or
        QUEUE_FULL (bounded, and the queue is full). Cancelled by `release` of the same request id."""
        try:
            _, waited = await self._acquire(request_id, bounded)
        except QueueFull:
            metrics.record_admission_rejection(TARGET.lower())
            return QUEUE_FULL
        return waited

    async def _acquire(self, request_id: str, bounded: bool) -> tuple[int, float]:
        self._loop = asyncio.get_running_loop()
        new = self.slots.slot_of(request_id) is None
        slot, waited = await self.slots.acquire(request_id, bounded)
        if new:
            metrics.record_admission_wait(waited, TARGET.lower())
        return slot, waited

    async def verify(self, row: VerifyCall, trace: Optional[dict] = None) -> Verdict | str:
        """-> the row's Verdict, CACHE_MISS, STALE (an older owner's call), or PREEMPTED (its slot was taken back under
        memory pressure). A request not admitted yet (e.g. its slot was reclaimed) first waits for a slot."""
        with tracing.span("target.verify", parent=trace, request_id=row.request_id, start=row.start,
                          num_draft=len(row.draft.tokens), prefill=row.prefix is not None):
            if self.slots.slot_of(row.request_id) is None:
                await self._acquire(row.request_id, bounded=False)
            self.slots.touch(row.request_id)
            return await self.batcher.submit(row.request_id, row)

    async def verify_steps(self, row: VerifyCall, trace: Optional[dict] = None) -> AsyncIterator[Verdict | str]:
        """Up to `row.steps` passes for one request, a Ray streaming generator: each pass's answer is yielded as soon
        as the pass is done, and the next pass's call is made here from the verdict, so no round trip to the
        coordinator lies between two passes (each still batched with every other request's rows). Stops after an
        answer that is not a Verdict (CACHE_MISS, STALE, PREEMPTED: the coordinator handles it as after `verify`),
        at the request's token budget or a stop id, and once the request's slot is released (it finished at a stop
        string, or was cancelled)."""
        while True:
            verdict = await self.verify(row, trace)
            yield verdict
            if not isinstance(verdict, Verdict) or row.ends_with(verdict):
                return
            row = row.after(verdict)
            if self.slots.slot_of(row.request_id) is None:
                return

    async def release(self, request_ids: Sequence[str], epoch: int = 0) -> None:
        """Free the requests' slots and state. A release by an older owner than the newest one served (`epoch`
        below it: a coordinator that lost the request) is ignored; 0 releases unconditionally."""
        request_ids = [rid for rid in request_ids if self.epochs.current(rid, epoch)]
        for rid in request_ids:
            self.batcher.forget(rid)
        try:
            await self.batcher.run_in_worker(lambda: self._release(request_ids))  # between passes, never during one
        finally:  # even when this call is cancelled on the way: a slot must never stay held by a finished request
            for rid in request_ids:
                self.slots.release(rid)  # also drops a place in the queue (an admit still waiting)

    def _release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._drop_cache(rid)
            self.epochs.forget(rid)

    def _drop_cache(self, rid: str) -> None:
        """The request's slot is no longer its own: forget what was fed there."""
        self._prefilling.pop(rid, None)
        self._fed.pop(rid, None)
        self._prefix_features.pop(rid, None)
        self._ctx.pop(rid, None)
        if self._head_read.pop(rid, None) is not None and self.drafter is not None:
            self.drafter.release(rid)

    def _preempt(self, rid: str) -> None:
        """On the event loop, after a pass that ran out of memory: take `rid`'s slot back and retire it."""
        if self.slots.preempt(rid) is not None:
            metrics.record_preemption(TARGET.lower())
            logger.warning("out of memory in a target pass: preempted %s, %d slots in service", rid,
                           self.slots.capacity - 1)

    # -- the pass (worker thread) ------------------------------------------------------------------------
    def _run_batch(self, rows: Sequence[VerifyCall]) -> list[Any]:
        try:
            return self._run_rows(rows)
        except (torch.cuda.OutOfMemoryError, MemoryError):
            if len(rows) < 2 or self._loop is None or not self.slots.can_preempt():
                raise
            # Memory pressure: the youngest request of the pass gives its slot back (and is queued again); the
            # others run again in the next pass, which is a row smaller. What the failed pass wrote lies beyond
            # every row's committed length (or in a prefill that restarts), so nothing needs undoing.
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            victim = max(rows, key=lambda r: self.slots.seq.get(r.request_id, 0)).request_id
            self._prefilling.pop(victim, None)
            self._loop.call_soon_threadsafe(self._preempt, victim)
            return [PREEMPTED if r.request_id == victim else AGAIN for r in rows]

    def _run_rows(self, rows: Sequence[VerifyCall]) -> list[Any]:
        t0 = time.perf_counter()
        results: list[Any] = [None] * len(rows)
        live: list[int] = []
        with torch.inference_mode():
            for b, r in enumerate(rows):
                if not self.epochs.admits(r.request_id, r.epoch):  # its coordinator lost the request
                    results[b] = STALE
                    continue
                if self.slots.slot_of(r.request_id) is None:  # released while its call was queued
                    results[b] = PREEMPTED
                    continue
                self.slots.touch(r.request_id)  # alive: a long prefill spans many passes
                if r.prefix is not None:
                    assert len(r.prefix) == r.start, f"prefix has {len(r.prefix)} tokens, start is {r.start}"
                    slot = self.slots.slot_of(r.request_id)
                    done = self._prefilling.pop(r.request_id, 0)
                    if r.start > done:  # chunked prefill: at most PREFILL_CHUNK prompt tokens per pass
                        end = min(r.start, done + PREFILL_CHUNK)
                        tokens = torch.tensor([r.prefix[done:end]], dtype=torch.int64)  # runners move it
                        args = (tokens, torch.full((1,), done, dtype=torch.int64),
                                torch.tensor([slot], dtype=torch.int64))
                        if self.feature_layers:
                            states = self.model.forward_features(*args, self.feature_layers, end - done - 1)[1][0]
                            self._prefilled(r, done, states)
                        else:
                            self.model.forward(*args, end - done - 1)
                        if end < r.start:  # the rest in later passes; running requests step in between
                            self._prefilling[r.request_id] = end
                            results[b] = AGAIN
                            continue
                    self._fed[r.request_id] = r.start
                    if r.start == 0:
                        self._prefilled(r, 0, None)
                    if self._lookup is not None:  # the lookup indexes the committed tokens afresh
                        self._ctx[r.request_id] = list(r.prefix) + [r.pending]
                        self._lookup.release(r.request_id)
                        self._lookup.admit(r.request_id, self._ctx[r.request_id])
                elif self._fed.get(r.request_id, -1) < r.start or (
                        self.head is not None and self._head_read.get(r.request_id) != r.start) or (
                        self._lookup is not None and len(self._ctx.get(r.request_id, ())) != r.start + 1):
                    results[b] = CACHE_MISS
                    continue
                live.append(b)
            if live:
                outs = self._verify_rows([rows[b] for b in live])
                for b, out in zip(live, outs):
                    results[b] = out
        self.compute_s += time.perf_counter() - t0
        metrics.record_verify_latency(time.perf_counter() - t0, scope="compute")
        return results

    def _verify_rows(self, rows: Sequence[VerifyCall]) -> list[Verdict]:
        dev = self.device
        # Tokens, positions and slots stay on the host: runners read the positions without a device sync, the graph
        # path sends all three in one copy, and a tensor-parallel leader broadcasts them from the host anyway (a
        # device copy made it copy them back, a sync).
        pending = torch.tensor([r.pending for r in rows], dtype=torch.int64)
        slots = torch.tensor([self.slots.slot_of(r.request_id) for r in rows], dtype=torch.int64)
        positions = torch.tensor([r.start for r in rows], dtype=torch.int64)
        sampling = SamplingTensors.from_params([r.params for r in rows], dev)
        steps = torch.tensor([r.step for r in rows], dtype=torch.int64, device=dev)
        if self.drafter is not None and any(r.head_draft > 0 for r in rows):  # the engine's propose, on this worker
            heads = [ProposeRow(r.request_id, self._ctx.get(r.request_id, ()), r.head_draft, r.params.greedy)
                     for r in rows]
            catch_up(self.drafter, heads)  # prompt lookup indexes the tokens committed since
            draft = propose(self.drafter, heads, sampling, steps, max(r.draft_top_k for r in rows) or 1).to(dev)
        else:
            draft = pack([r.draft for r in rows])
        verdicts = verify_and_accept(self.model, pending, draft, positions, slots, sampling, steps,
                                     self.feature_layers)
        for r, v in zip(rows, verdicts):
            self._fed[r.request_id] = max(self._fed.get(r.request_id, 0), r.start + 1 + v.num_draft)
            if r.request_id in self._ctx:
                self._ctx[r.request_id].extend(v.tokens)
            if v.features is None:
                continue
            if self.head is not None:  # the head reads the newly committed positions' states here
                self.head.observe(r.request_id, r.start, v.features, v.tokens)
                self._head_read[r.request_id] = r.start + len(v.tokens)
                v.features = None
            else:  # they travel to the head on a drafter replica, after the prefix's if this call prefilled
                prefix = self._prefix_features.pop(r.request_id, None)
                if prefix:
                    v.features = HeadFeatures.of(0, torch.cat([*prefix, v.features]))
                else:
                    v.features = HeadFeatures.of(r.start, v.features)
        return verdicts

    def _prefilled(self, r: VerifyCall, done: int, states: Optional[torch.Tensor]) -> None:
        """A prefill chunk fed positions done..done+n-1 of `r.prefix` and computed their states [n, F] (None: an
        empty prefix): the head reads them here, or they wait to travel with the verdict."""
        rid = r.request_id
        if done == 0:  # a prefill from the start: the head reads the request afresh
            self._prefix_features.pop(rid, None)
            if self.head is not None:
                self.head.release(rid)
                self.head.admit(rid, ())
                self._head_read[rid] = 0
        if states is None:
            return
        n = states.shape[0]
        if self.head is not None:
            follow = (list(r.prefix) + [r.pending])[done + 1: done + 1 + n]  # the token after each position
            self.head.observe(rid, done, states, follow)
            self._head_read[rid] = done + n
        else:
            self._prefix_features.setdefault(rid, []).append(states)


class TargetServer(ModelHost):
    """The Serve replica of the target deployment: starts the workers, answers control calls, health."""

    async def __init__(self, config: dict[str, Any]) -> None:
        cfg = AppConfig.model_validate(config)
        t = cfg.target
        spawn = spawn_tensor_parallel_workers if t.tensor_parallel_size > 1 else spawn_workers
        self.workers = spawn(
            TargetWorker, TARGET, t.resources, t.tensor_parallel_size,
            model=t.model, max_batch_size=t.max_batch_size, max_seq_len=t.max_seq_len, device=t.device,
            dtype=t.dtype, torch_threads=t.resources.torch_threads, batch_wait_ms=t.batch_wait_ms,
            kv_cache_gb=t.kv_cache_gb, kv_cache_fraction=t.kv_cache_fraction, max_waiting=t.max_waiting,
            **({"tp_allreduce": t.tp_allreduce} if t.tensor_parallel_size > 1 else {}),
            **({"head": cfg.drafter.head, "head_in_target": cfg.drafter.head_in_target} if cfg.drafter.head else {}),
            **({"tree": cfg.drafter.tree.config()} if cfg.drafter.tree is not None else {}),
        )
        self._info = await self.workers[0].info.remote()  # waits for the model to load

