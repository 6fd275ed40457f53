"""Drafter replicas: a Serve host plus a worker actor holding a drafter (`pipeline.drafters.ModelDrafter`; for a draft
model of another tokenizer than the target's, `pipeline.cross_tokenizer.CrossTokenizerDrafter` around it).

Context protocol, per request: the worker mirrors the request's context. A call names `base`, a length of
context the worker already holds, and sends only `new = context[base:]` (a few ids per step instead of
the whole context). A worker that holds less than `base` (restarted, request moved) answers CACHE_MISS and
the coordinator resends with base 0. The drafter's own KV cache keeps the longest prefix that still
matches, so a block drafted optimistically and then rejected costs nothing to roll back.

A feature head (`drafter.head_placement: drafter`, `pipeline.heads.drafter.HeadDrafter`) mirrors the context the
same way and reads, from each call's `features`, the target's states of the positions committed since the last call
(`messages.HeadFeatures`). Before it drafts it must have read exactly the committed positions but the pending
token's; else (restarted, moved, or states it never got) it answers CACHE_MISS, and the coordinator has the target
re-prefill the request, which sends the states of the whole prefix. It loads the target model for the weights it
shares (EAGLE-3: the embedding; Medusa: the output layer); no pre-speculation.

Token trees (`drafter.tree` with a draft model): a call with `tree` set is drafted by `pipeline.tree.TreeDrafter` over
the same `ModelDrafter`, as in the engine: the request's K caps the tree's depth, and the answer is the tree's nodes
(breadth first) with their parents and sparse distributions. The draft cache then holds the context and the first
node, and the next call's context (the accepted path and the target's token) is fed from where the two part, as
after a chain: the cache follows the accepted path without a copy. No pre-speculation (it drafts chains).

Slots (deployments.admission): a request acquires one (`admit`, after its target slot, so two requests never wait
for each other's) before it drafts here and keeps it until it is released; while all are held the next request
waits its turn instead of evicting another one's cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

import torch

from deployments import metrics, tracing
from deployments.admission import SlotQueue
from deployments.batching import StepBatcher
from deployments.config import DRAFTER, AppConfig
from deployments.messages import PrespecCall, ProposeCall
from deployments.workers import CACHE_MISS, STALE, EpochFence, ModelHost, kv_slots, spawn_workers, warm_up
from pipeline.compat import IncompatibleDrafter
from pipeline.config import TreeConfig, is_head, is_synthetic
from pipeline.cross_tokenizer import CrossTokenizerDrafter, cross_tokenizer_problem, same_vocabulary
from pipeline.drafters import ModelDrafter, ProposeRow
from pipeline.heads.drafter import HeadDrafter
from pipeline.models.graphs import graphs_on_cuda
from pipeline.models.loader import load_model, load_tokenizer
from pipeline.models.store import DEMO_TARGET, resolve
from pipeline.prespec import assign_keys, group_keys
from pipeline.sampling import SamplingTensors
from pipeline.step import CACHE_SLACK, Draft, catch_up, propose
from pipeline.synthetic import SyntheticDrafter
from pipeline.tree import TreeDrafter, supports_tree

logger = logging.getLogger(__name__)


class DrafterWorker:
    """Holds one drafter model and serves batched propose calls."""

    def __init__(
        self, model: str, max_batch_size: int, max_seq_len: int, device: str = "cpu",
        dtype: str = "float32", torch_threads: int = 1, batch_wait_ms: float = 0.0,
        rank: int = 0, world_size: int = 1, kv_cache_gb: Optional[float] = None, kv_cache_fraction: float = 0.9,
        target: Optional[str] = None,  # the target model: a draft model of another tokenizer drafts through text
        prespec_branches: int = 0,  # KV-cache slots per request for pre-speculated branches (pipeline.prespec)
        tree: Optional[TreeConfig] = None,  # `drafter.tree`: calls that ask for a tree get one of this shape
    ) -> None:
        torch.set_num_threads(torch_threads)
        self.tree_drafter: Optional[TreeDrafter] = None  # the draft model drafting token trees (`ProposeCall.tree`)
        self._head_read: dict[str, int] = {}  # a feature head: request id -> committed positions [0, n) it has read
        if is_head(model):
            self._init_head(model, max_batch_size, max_seq_len, device, dtype, batch_wait_ms, target)
            return
        if is_synthetic(model):  # a measurement aid: a random-weight model of a shape, the recorded continuation
            synthetic = SyntheticDrafter.from_spec(model, device=device, dtype=dtype)
            runner = synthetic.model
        else:
            runner, draft_tok = load_model(str(resolve(model)), device=device, dtype=dtype)
        runner = graphs_on_cuda(runner)  # CUDA: captured decode steps; CPU unchanged
        # Each request holds a group of cache slots: its own and one per pre-speculated branch.
        physical = kv_slots(runner, device, kv_cache_gb, kv_cache_fraction, max_seq_len + CACHE_SLACK,
                            max_batch_size * (1 + prespec_branches), "drafter")
        num_slots = max(1, physical // (1 + prespec_branches))  # requests
        runner.allocate(physical, max_seq_len + CACHE_SLACK)
        warm_up(runner, physical, "drafter")
        if is_synthetic(model):
            synthetic.model = runner
            self.drafter: ModelDrafter | CrossTokenizerDrafter = synthetic
        else:
            self.drafter = ModelDrafter(runner)
            target_tok = load_tokenizer(str(resolve(target))) if target is not None and draft_tok is not None else None
            if target_tok is not None and draft_tok is not None and not same_vocabulary(target_tok, draft_tok):
                problem = cross_tokenizer_problem(target_tok, draft_tok)
                if problem is not None:
                    raise IncompatibleDrafter(f"draft model {model} has another tokenizer than the target and cannot "
                                              f"draft through text: {problem}")
                logger.info("drafter %s: another tokenizer than the target's; drafting through text", model)
                self.drafter = CrossTokenizerDrafter(self.drafter, target_tok, draft_tok)
        if tree is not None:
            self.tree_drafter = _tree_drafter(self.drafter, tree)
        # Branches draft under slot keys of their own (`pipeline.prespec.group_keys`): a draft model's cache slots
        # (ModelDrafter, the synthetic drafter). A drafter through text keeps per-request state: no branches.
        self.branches = (min(prespec_branches, physical // num_slots - 1) if isinstance(self.drafter, ModelDrafter)
                         else 0)
        if self.branches:
            self.drafter.greedy_spread = True  # greedy rows ship what ranks their outcomes
        self._ctx: dict[str, list[int]] = {}
        self.epochs = EpochFence()  # calls of a coordinator that lost the request are refused (STALE)
        # Admission is never refused here (max_waiting: every request that holds a target slot may queue).
        self.slots = SlotQueue(num_slots, max_waiting=1 << 30, on_free=self._free_later,
                               on_queue=lambda n: metrics.set_admission_queue(n, DRAFTER.lower()))
        self.batcher = StepBatcher(self._run_batch, num_slots, batch_wait_ms, name="drafter")
        self.prespec_rows = 0  # branch rows drafted (statistics)
        self.compute_s = 0.0

    def _init_head(self, spec: str, max_batch_size: int, max_seq_len: int, device: str, dtype: str,
                   batch_wait_ms: float, target: Optional[str]) -> None:
        """A feature head on the target model's shared weights (the target's KV cache is never allocated here)."""
        runner, _ = load_model(str(resolve(target)), device=device, dtype=dtype)
        self.drafter = HeadDrafter.from_spec(spec, runner)
        self.drafter.allocate(max_batch_size, max_seq_len + CACHE_SLACK)
        self._head_info = {"name": self.drafter.name, "path": spec, "vocab_size": runner.info.vocab_size}
        self.branches = 0
        self._ctx = {}
        self.epochs = EpochFence()
        self.slots = SlotQueue(max_batch_size, max_waiting=1 << 30, on_free=self._free_later,
                               on_queue=lambda n: metrics.set_admission_queue(n, DRAFTER.lower()))
        self.batcher = StepBatcher(self._run_batch, max_batch_size, batch_wait_ms, name="drafter")
        self.prespec_rows = 0
        self.compute_s = 0.0

    async def info(self) -> dict[str, Any]:
        if isinstance(self.drafter, HeadDrafter):
            return self._head_info
        i = self.drafter.model.info
        return {"name": i.name, "path": i.path, "vocab_size": i.vocab_size}

    async def ping(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batcher.batches, "rows": self.batcher.rows, "compute_s": self.compute_s,
                "prespec_rows": self.prespec_rows, "branch_slots": self.branches,
                "requests": len(self._ctx), "slots_used": len(self.slots.holders), "waiting": self.slots.waiting,
                "active_requests": self.batcher.active() + self.slots.waiting}

    async def admit(self, request_id: str) -> float:
        """Take a slot for the request, waiting in FIFO order while all are held. -> seconds waited. Cancelled by
        `release` of the same request id."""
        new = self.slots.slot_of(request_id) is None
        _, waited = await self.slots.acquire(request_id, bounded=False)
        if new:
            metrics.record_admission_wait(waited, DRAFTER.lower())
        return waited

    async def propose(self, row: ProposeCall, trace: Optional[dict] = None) -> Draft | str:
        """-> the row's Draft (with the sparse distribution it was drawn from), CACHE_MISS, or STALE."""
        with tracing.span("drafter.propose", parent=trace, request_id=row.request_id, base=row.base,
                          num_draft=row.num_draft):
            self.slots.touch(row.request_id)
            return await self.batcher.submit(row.request_id, row)

    async def prespec(self, call: PrespecCall, trace: Optional[dict] = None) -> list[Optional[Draft]] | str:
        """Draft the next step for each of `call.tails` (likely outcomes of the step being verified) in one batched
        pass -> one Draft per tail (None past this worker's branch slots), CACHE_MISS, or STALE."""
        with tracing.span("drafter.prespec", parent=trace, request_id=call.request_id, branches=len(call.tails)):
            self.slots.touch(call.request_id)
            return await self.batcher.submit(call.request_id, call)

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

    def _free_later(self, rid: str) -> None:
        """A slot taken back (an idle holder's): drop the request's drafter state between passes."""
        task = asyncio.ensure_future(self.batcher.run_in_worker(lambda: self._release([rid])))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._ctx.pop(rid, None)
            self._head_read.pop(rid, None)
            self.epochs.forget(rid)
            for key in group_keys(rid, self.branches):
                self.drafter.release(key)

    def _run_batch(self, calls: Sequence[ProposeCall | PrespecCall]) -> list[Any]:
        """The engine's propose path (`pipeline.step`) over this pass's rows: a propose call is one row, a
        pre-speculation call one row per branch; each row drafts in the slot of its request's group whose cache
        shares the longest prefix with its context (`pipeline.prespec.assign_keys`). Rows that ask for token trees
        are drafted in a call of their own, by the tree drafter (`ProposeCall.tree`)."""
        t0 = time.perf_counter()
        results: list[Any] = [None] * len(calls)
        rows: list[ProposeRow] = []
        owners: list[tuple[int, int]] = []  # per row: (call index, branch index or -1)
        trees: list[bool] = []  # per row: drafts a token tree
        params, steps, top_k = [], [], 1
        for b, c in enumerate(calls):
            if not self.epochs.admits(c.request_id, c.epoch):  # its coordinator lost the request
                results[b] = STALE
                continue
            held = self._ctx.get(c.request_id)
            if held is None and c.base > 0 or held is not None and len(held) < c.base:
                results[b] = CACHE_MISS
                continue
            ctx = (held[: c.base] if held is not None else []) + list(c.new)
            if isinstance(c, PrespecCall):
                # The mirror holds committed tokens only; a late pre-speculation never shortens a newer mirror.
                if held is None or len(held) <= len(ctx) or held[: len(ctx)] != ctx:
                    self._ctx[c.request_id] = ctx
                wanted = [(ctx + list(tail), n) for tail, n in zip(c.tails, c.num_draft)][: self.branches]
                results[b] = [None] * len(c.tails)
            else:
                self._ctx[c.request_id] = ctx
                wanted = [(ctx, c.num_draft)]
                if isinstance(self.drafter, HeadDrafter) and not self._head_reads(c, ctx):
                    results[b] = CACHE_MISS
                    continue
            group = group_keys(c.request_id, self.branches)
            held_by = {k: self.drafter.cached(k) for k in group} if self.branches else {}
            keys = assign_keys(group, held_by, [w for w, _ in wanted])
            for j, ((context, n), key) in enumerate(zip(wanted, keys)):
                rows.append(ProposeRow(key, context, n))
                owners.append((b, j if isinstance(c, PrespecCall) else -1))
                trees.append(isinstance(c, ProposeCall) and c.tree and self.tree_drafter is not None)
                params.append(c.params)
                steps.append(c.step)
            top_k = max(top_k, c.draft_top_k)
        for tree in (False, True):  # chains and trees: a drafter call each
            group = [r for r in range(len(rows)) if trees[r] == tree]
            if not group:
                continue
            drafter = self.tree_drafter if tree else self.drafter
            device = self.drafter.device  # the draft model's: its sampling runs there
            sampling = SamplingTensors.from_params([params[r] for r in group], device)
            step_t = torch.tensor([steps[r] for r in group], dtype=torch.int64, device=device)
            part = [rows[r] for r in group]
            with torch.inference_mode():
                catch_up(drafter, part)
                block = propose(drafter, part, sampling, step_t, top_k).to("cpu")
            drafted = block.num_draft.tolist()  # a head may draft fewer (Medusa: one token a head); a tree: its nodes
            for i, r in enumerate(group):
                b, j = owners[r]
                draft = Draft.of(block, i, drafted[i] if tree else min(rows[r].num_draft, drafted[i]))
                if j < 0:
                    results[b] = draft
                else:
                    results[b][j] = draft
                    self.prespec_rows += 1
        self.compute_s += time.perf_counter() - t0
        metrics.record_draft_latency(time.perf_counter() - t0, scope="compute")
        return results

    def _head_reads(self, call: ProposeCall, ctx: list[int]) -> bool:
        """The feature head reads the call's states (each position paired with the committed token after it)
        -> whether it has now read exactly positions [0, len(ctx) - 1), as drafting needs."""
        rid, f = call.request_id, call.features
        if f is not None and f.start <= self._head_read.get(rid, 0) and f.start + f.length < len(ctx):
            if f.start == 0:
                self.drafter.release(rid)
            self.drafter.admit(rid, ())
            head_dtype = next(self.drafter.head.parameters()).dtype
            self.drafter.observe(rid, f.start, f.tensor().to(self.drafter.device, head_dtype),
                                 ctx[f.start + 1: f.start + 1 + f.length])
            self._head_read[rid] = f.start + f.length
        return self._head_read.get(rid) == len(ctx) - 1


class DrafterServer(ModelHost):
    """The Serve replica of the drafter deployment."""

    async def __init__(self, config: dict[str, Any]) -> None:
        cfg = AppConfig.model_validate(config)
        d = cfg.drafter
        tree = cfg.model_tree  # pre-speculation drafts chains: no branch slots with trees
        if d.tree is not None and d.uses_model and tree is None:
            logger.warning("drafter.tree: the target is tensor parallel (no tree attention); drafting chains")
        self.workers = spawn_workers(
            DrafterWorker, DRAFTER, d.resources, 1,
            model=d.model or d.head, max_batch_size=d.max_batch_size, max_seq_len=cfg.target.max_seq_len,
            device=d.device, dtype=d.dtype, torch_threads=d.resources.torch_threads, batch_wait_ms=d.batch_wait_ms,
            kv_cache_gb=d.kv_cache_gb, kv_cache_fraction=d.kv_cache_fraction, target=cfg.target.model or DEMO_TARGET,
            prespec_branches=cfg.coordinator.prespec_branches if cfg.coordinator.overlap and not tree else 0,
            tree=tree,
        )
        self._info = await self.workers[0].info.remote()


def _tree_drafter(drafter: Any, tree: TreeConfig) -> Optional[TreeDrafter]:
    """The draft model drafting trees of `tree`'s shape (`pipeline.tree.TreeDrafter`, as the engine's), or None where
    it cannot (logged): a draft model through text, or one on a runner without tree attention, drafts chains."""
    if type(drafter) is not ModelDrafter:
        logger.warning("drafter.tree: drafter %s drafts through text (another tokenizer); drafting chains",
                       drafter.name)
        return None
    if not supports_tree(drafter.model):
        logger.warning("drafter.tree: draft model %s runs on %s, which has no tree attention; drafting chains",
                       drafter.name, type(drafter.model).__name__)
        return None
    return TreeDrafter(drafter, tree)
