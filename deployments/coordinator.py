"""The coordinator: runs each request's loop  draft -> verify and accept -> commit -> persist -> stream.

One Serve deployment; each replica runs many request loops concurrently on its event loop. The hot loop
calls the drafter and target *worker actors* directly (see workers.py); a request sticks to one target
worker (its KV cache) and one drafter worker while they live.

Per step (step t of a request with committed context C_t, last token "pending"), over the pieces of
`pipeline.step` that `SpeculativeEngine` runs too:
1. draft: the budget (`draft_budgets`), then the drafts: prompt lookup in-process, a model on a drafter worker,
   or lookup first and the model elsewhere (`lookup_first`). With overlap on, the drafter is asked for K+1
   tokens: the last is its guess of the bonus token, and its distribution there ranks the bonus candidates.
2. verify and accept: one call to the target worker (`verify_and_accept` there, batched with other requests'
   calls; uniforms from (seed, step)), which answers the emitted tokens (`Verdict`); while it runs, the
   drafter already drafts step t+1 for the likeliest outcomes of step t (pre-speculation, `pipeline.prespec`:
   accepted length and recovered/bonus token, ranked by the drafter's own probabilities, `prespec_branches` of
   them in one batched pass). The verdict picks the branch it matches, whose draft is then used; else a fresh
   draft is made.
3. commit the verdict to the RequestState.
4. persist the step to Redis *asynchronously* (ordered per request, fenced by owner and step; not on the
   critical path: a step lost in a crash is regenerated identically from (seed, step)), and yield it.
Failures: a lost drafter -> another drafter, else target-only steps; a lost target -> another target,
rebuilt from the committed token ids (prefill); a cache miss -> the same with the prefix.

Feature heads (`drafter.head_placement`): in the target, a verify call asks the target worker's head for the step's
draft (`head_draft`), which it drafts right before verifying it; on a drafter replica, each verdict brings the
target's states of the newly committed positions (`HeadFeatures`), which the next propose call takes to the
drafter. Neither pre-speculates: a head's next draft needs the states of the step's outcome.

Token trees of a draft model (`drafter.tree`, `AppConfig.model_tree`): each propose call asks the drafter worker for a
tree (`ProposeCall.tree`) of depth up to the step's K, which travels on in the verify call as nodes, parents and sparse
probabilities; the target worker verifies it in one pass (`verify_and_accept`, the engine's) and keeps the accepted
path. Their shape is static: no adaptive K, and no pre-speculation (it drafts chains).

Admission (deployments.admission): before its first step a request takes a KV-cache slot on a target worker
(`_admit`: the least loaded one; when its queue is full, the next; when every one is full, HTTP 429), waiting there
in FIFO order while all slots are held, then one on its drafter worker. It keeps them until it finishes, fails, is
cancelled or abandoned (`_release`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import ray
import torch
from ray import serve

from deployments import metrics, tracing  # tracing is a no-op unless OTEL_EXPORTER_OTLP_ENDPOINT is set
from deployments.admission import PREEMPTED, QUEUE_FULL
from deployments.config import DRAFTER, TARGET, AppConfig
from deployments.messages import (
    ErrorEvent,
    GenerateRequest,
    HeadFeatures,
    PrespecCall,
    ProposeCall,
    StepEvent,
    VerifyCall,
    spec_from_json,
    spec_to_json,
)
from deployments.protocol import APIError
from deployments.redis_state import NotOwner, RequestStore, redis_url_getter
from deployments.workers import CACHE_MISS, STALE, WorkerPool, is_actor_lost
from pipeline.config import SpecParams
from pipeline.drafters import ProposeRow, lookup_first, lookup_part
from pipeline.models.loader import load_tokenizer
from pipeline.prespec import match_branch, rank_branches
from pipeline.sequence import RequestState
from pipeline.step import Draft, Verdict, commit, draft_budgets, new_k_policy, retire, row_budget

logger = logging.getLogger(__name__)


@dataclass
class _PendingPropose:
    """Pre-speculation for step `step` (`pipeline.prespec`): the drafter drafts it for each context
    `context[:base] + tails[i]` while the step before is verified; the verdict picks the branch it matches."""

    step: int
    base: int  # the committed length when it was sent: the drafter's mirror then holds context[:base]
    tails: list[list[int]]  # per branch: the accepted drafts, then the guessed recovered or bonus token
    task: asyncio.Task  # -> one Draft (or None) per branch, CACHE_MISS or STALE
    ref: Any = None  # the Ray call, cancelled in the drafter when the drafts are dropped
    hit: int = -1  # the branch the verdict matched; -1: none (yet)


@dataclass
class _Run:
    """Mutable per-request loop state (never persisted: everything here can be rebuilt)."""

    spec: SpecParams
    epoch: int = 1  # the request's ownership epoch (Redis counts take-overs): workers refuse calls of older ones
    target: Optional[str] = None
    target_handle: Any = None
    target_warm: bool = False  # the target worker holds this request's committed tokens
    maybe_warm: bool = False  # resumed: `target` may still hold them (tried without a prefix first)
    drafter: Optional[str] = None
    drafter_handle: Any = None
    drafter_base: int = -1  # committed context length the drafter worker mirrors; -1: nothing
    pre: Optional[_PendingPropose] = None
    persist: Optional[asyncio.Task] = None
    persist_broken: bool = False
    overlap_hit_rate: float = 1.0  # running estimate of how often a pre-draft is used (optimistic start)
    steps: int = 0  # steps this loop ran (its first one also prefills the target: not a measure of K's cost)
    k_used: dict[int, int] = field(default_factory=dict)  # K of this request's steps -> count
    timing: dict[str, float] = field(default_factory=lambda: {"draft_s": 0.0, "verify_s": 0.0, "step_s": 0.0})
    trace: Optional[dict] = None  # W3C context of this request's coordinator span (deployments.tracing)
    queue_wait_s: float = 0.0  # time spent waiting for KV-cache slots (target and drafter)
    # accepted length of a step verified while pre-speculation was in flight -> [steps, steps a branch matched]
    prespec_by_accepted: dict[int, list[int]] = field(default_factory=dict)
    # A feature head on a drafter replica: the target's states not yet sent to it, and whether it needs them all
    # again (it lost the request: the next verify call re-prefills the target, which returns the prefix's states)
    head_features: Optional[HeadFeatures] = None
    head_refeed: bool = False
    counters: dict[str, int] = field(default_factory=lambda: {
        "overlap_tries": 0, "overlap_hits": 0, "target_replays": 0, "target_failovers": 0,
        "drafter_failovers": 0, "steps_without_draft": 0, "preemptions": 0, "multi_step_calls": 0})


class Coordinator:
    async def __init__(self, config: dict[str, Any], target: Any, drafter: Any = None, redis: Any = None) -> None:
        torch.set_num_threads(1)
        self.cfg = AppConfig.model_validate(config)
        self.info = await target.info.remote()  # waits until a target replica is up
        self.store = await RequestStore.connect(redis_url_getter(self.cfg, redis), self.cfg.redis_namespace,
                                                self.cfg.request_ttl_s)
        self.tokenizer = load_tokenizer(self.info["path"])
        ctx = serve.get_replica_context()
        self.targets = WorkerPool(ctx.app_name, TARGET)
        d = self.cfg.drafter
        self.drafters = WorkerPool(ctx.app_name, DRAFTER) if d.runs_drafters else None  # the model part, remote
        self.head_in_target = d.head_in_target  # the target workers draft with a feature head themselves
        self.head_on_drafter = d.head is not None and not d.head_in_target
        # Prompt lookup (alone or before the model: hybrid) or suffix decoding, in-process. Suffix decoding's store of
        # finished outputs is this replica's own (pipeline.suffix says why it is not shared through Redis).
        self.lookup = None if d.head_in_target else lookup_part(d.draft)  # a head's lookup runs beside it
        self.owner = f"{ctx.replica_id.unique_id}:{uuid.uuid4().hex[:8]}"
        self.active = 0
        # Abandon tasks (mark a request cancelled, free its slots) run after their stream is gone: the loop keeps
        # only weak references to tasks, so one nobody holds can be collected before it finishes.
        self._abandoning: set[asyncio.Task] = set()
        # A draft model's token trees (`drafter.tree`), where the target verifies trees: the drafter worker drafts
        # them, the target worker verifies them. Their shape is static (the request's K caps the depth), as in the
        # engine: no adaptive K. Pre-speculation drafts chains: none with a tree configured (the drafter replicas
        # hold no branch slots then).
        self.trees = self.cfg.model_tree is not None and bool(self.info.get("supports_tree"))
        self.prespec = self.cfg.coordinator.overlap and d.head is None and self.cfg.model_tree is None
        if self.cfg.model_tree is not None and not self.trees:
            logger.warning("drafter.tree: the target runs without tree attention; drafting chains")
        if self.trees and (self.cfg.coordinator.overlap or self.cfg.coordinator.adaptive_k):
            logger.info("drafter.tree: a draft model's token trees run without pre-speculation and adaptive K (the "
                        "tree's shape is static; pre-speculation drafts chains)")
        # A head's trees in the target worker are static shapes too: no adaptive K, as in the engine.
        head_trees = d.head is not None and d.tree is not None and bool(self.info.get("supports_tree"))
        if head_trees and self.cfg.coordinator.adaptive_k:
            logger.info("drafter.tree: the feature head's token trees run without adaptive K (the tree's shape is "
                        "static; the request's K caps its depth)")
        # One K policy per coordinator, over its requests; bucketed by how many it is serving.
        adaptive = self.cfg.coordinator.adaptive_k and d.drafts and not (self.trees or head_trees)
        self.k_policy = new_k_policy() if adaptive else None

    async def model_info(self) -> dict[str, Any]:
        return {**self.info, "drafter": self.cfg.drafter.draft, "has_tokenizer": self.tokenizer is not None}

    # -- entry points (Serve streaming calls) ----------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[StepEvent | ErrorEvent]]:
        """Start a request. Yields lists of StepEvents, or one ErrorEvent (errors travel as data: the ingress tells
        them from a lost replica)."""
        async for events in _guard(self._generate(request)):
            yield events

    async def resume(self, request_id: str, after: int = -1) -> AsyncIterator[list[StepEvent | ErrorEvent]]:
        """Take a request over (its coordinator died, or its client reconnects) and stream the events after
        index `after`: first those already in Redis, then newly generated ones."""
        async for events in _guard(self._resume(request_id, after)):
            yield events

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[list[StepEvent]]:
        state = RequestState(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), params=request.params,
            eos_token_ids=tuple(self.info["eos_token_ids"]),
        )
        if self.tokenizer is not None:
            state.attach_tokenizer(self.tokenizer)
        run = _Run(spec=request.spec)
        with tracing.span("coordinator.admit", parent=request.trace, request_id=state.request_id):
            await self._admit(run, state.request_id, bounded=True)  # 429 before anything is stored
            try:
                await self.store.create(state.request_id, self.owner, state.to_dict(), kind=request.kind,
                                        model=request.model, created=request.created,
                                        spec=spec_to_json(request.spec))
            except BaseException:
                self._release(run, state.request_id)
                raise
            self._persist_fields(run, state.request_id, target_worker=run.target)
        async for events in self._loop(state, request.spec, prefer_target=None, trace=request.trace, run=run):
            yield events

    async def _resume(self, request_id: str, after: int) -> AsyncIterator[list[StepEvent]]:
        stored = await self.store.take_over(request_id, self.owner)
        if stored is None:
            raise APIError(f"unknown or expired request id {request_id!r}", 404, param="Last-Event-ID",
                           code="request_not_found")
        old = [StepEvent.from_json(e) for e in await self.store.events(request_id, after + 1)]
        if old:
            yield old
        if stored.finished:
            return
        state = RequestState.from_dict(stored.state_dict(), self.tokenizer)
        spec = spec_from_json(stored.json("spec"))
        async for events in self._loop(state, spec, prefer_target=stored.fields.get("target_worker"),
                                       epoch=int(stored.fields.get("epoch", 1))):
            events = [e for e in events if e.i > after]
            if events:
                yield events

    # -- the loop --------------------------------------------------------------------------------------
    async def _loop(self, state: RequestState, spec: SpecParams, prefer_target: Optional[str],
                    trace: Optional[dict] = None, run: Optional[_Run] = None,
                    epoch: int = 1) -> AsyncIterator[list[StepEvent]]:
        if run is None:  # resumed: admitted at its first step, on its old target worker if that still lives
            run = _Run(spec=spec, epoch=epoch)
            run.target, run.maybe_warm = prefer_target, prefer_target is not None
        # Not made current: it spans the generator's yields. Steps name it as their parent via run.trace.
        span = tracing.start_span("coordinator.request", parent=trace, request_id=state.request_id,
                                  k=spec.num_draft_tokens, coordinator=self.owner, resumed=prefer_target is not None)
        run.trace = tracing.carrier_of(span)
        self.active += 1
        self._gauge()
        finished_ok = False
        # The steps run in their own task and hand events over through a queue: handing an event to Serve's
        # stream (serialise, send to the ingress) then overlaps with the next step instead of delaying it,
        # and events that pile up while the consumer is slow travel together.
        queue: asyncio.Queue = asyncio.Queue()
        producer = asyncio.ensure_future(self._produce(run, state, queue))
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                events = [it for it in items if isinstance(it, StepEvent)]
                if events:
                    yield events
                for it in items:
                    if isinstance(it, BaseException):
                        raise it
                if _END in items:
                    break
            finished_ok = True
        finally:
            if not producer.done():
                producer.cancel()
            tracing.set_attributes(span, steps=state.step, completion_tokens=len(state.output_ids),
                                   finished=finished_ok)
            span.end()
            self.active -= 1
            self._gauge()
            if not finished_ok:
                # Cancelled (client gone), failed, or the generator was closed: stop the work, keep the state
                # resumable, free the replicas' slots. In a task: the current one may be cancelled.
                task = asyncio.get_running_loop().create_task(self._abandon(run, state))
                self._abandoning.add(task)
                task.add_done_callback(self._abandoning.discard)
            else:
                self._release(run, state.request_id)

    async def _produce(self, run: _Run, state, queue: asyncio.Queue) -> None:
        try:
            while not state.finished:
                if run.persist is not None and run.persist.done() and run.persist.exception() is not None:
                    if isinstance(run.persist.exception(), NotOwner):
                        raise _taken_over()
                if self._multi_step(run, state):
                    await self._steps(run, state, queue)
                else:
                    queue.put_nowait(await self._step(run, state))
            if self.lookup is not None:
                retire(self.lookup, state)  # suffix decoding learns the output; prompt lookup forgets the request
            # The slots are free for the next request now: not when the stream's generator is closed, which Serve may
            # leave to the garbage collector once the ingress has the last event.
            self._release(run, state.request_id)
            await self._flush(run)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - re-raised by the consumer side
            queue.put_nowait(err)

    async def _step(self, run: _Run, state: RequestState) -> StepEvent:
        with tracing.span("coordinator.step", parent=run.trace, step=state.step):
            return await self._step_body(run, state)

    async def _step_body(self, run: _Run, state: RequestState) -> StepEvent:
        """One step of one request, over `pipeline.step`: budget, draft (here and on a drafter worker), verify and
        accept (on a target worker, batched there with other requests' rows), commit."""
        t0 = time.perf_counter()
        [want], adapt = draft_budgets([state], run.spec.num_draft_tokens, self.k_policy, max(self.active, 1))
        if self.head_in_target or want == 0:
            draft, answer = Draft([]), None
        else:
            draft, answer = await self._draft(run, state, want)
        t1 = time.perf_counter()
        call = VerifyCall(request_id=state.request_id, start=state.length - 1, pending=state.last_token, draft=draft,
                          params=state.params, step=state.step, epoch=run.epoch)
        if self.head_in_target:
            call.head_draft, call.draft_top_k = want, run.spec.draft_top_k
        if run.head_refeed:  # the drafter's head needs the prefix's states: the target prefills again
            call.prefix, run.head_refeed = state.context[:-1], False
        verify_task = asyncio.ensure_future(self._verify(run, call, state))
        if answer is not None and self._overlap_wanted(run, state.step + 1):
            self._prespeculate(run, state, draft, answer)
        predrafted = run.pre is not None
        try:
            verdict = await verify_task
        except BaseException:
            verify_task.cancel()
            raise
        t2 = time.perf_counter()
        if self.head_on_drafter and isinstance(verdict.features, HeadFeatures):
            had = run.head_features
            run.head_features = verdict.features if had is None else had.then(verdict.features)
        return self._committed(run, state, verdict, (t0, t1, t2), want, adapt, predrafted)

    def _committed(self, run: _Run, state: RequestState, verdict: Verdict, times: tuple[float, float, float],
                   want: int, adapt: bool, predrafted: bool) -> StepEvent:
        """Commit a step's verdict to the request -> its event (persisted, its statistics recorded). times: the
        step's start, its draft's end, its verdict's arrival."""
        t0, t1, t2 = times
        run.timing["draft_s"] += t1 - t0
        run.timing["verify_s"] += t2 - t1
        k, num_accepted = verdict.num_draft, verdict.num_accepted
        expected_step = state.step
        committed, text = commit(state, verdict)
        run.steps += 1
        run.k_used[k] = run.k_used.get(k, 0) + 1
        if adapt:
            self.k_policy.observe(max(self.active, 1), k, time.perf_counter() - t0, [k], [num_accepted],
                                  timed=run.steps > 1)
        pre = run.pre
        if pre is not None:
            pre.hit = -1 if state.finished or pre.step != state.step else match_branch(
                pre.tails, state.context_view, pre.base)
            if predrafted and not state.finished:
                seen = run.prespec_by_accepted.setdefault(num_accepted, [0, 0])
                seen[0] += 1
                seen[1] += pre.hit >= 0
                run.counters["overlap_hits"] += pre.hit >= 0
                metrics.record_prespec(num_accepted, pre.hit >= 0)
            if pre.hit < 0 and state.params.greedy:
                self._drop_predraft(run)  # a sampled request's is settled before its next draft
        if predrafted:
            hit = run.pre is not None and run.pre.hit >= 0
            run.overlap_hit_rate = 0.7 * run.overlap_hit_rate + 0.3 * hit
        if want > 0 and k == 0:
            run.counters["steps_without_draft"] += 1  # no drafter reachable, or prompt lookup found nothing
        event = StepEvent(expected_step, committed, text, state.finish_reason)
        if state.finished:
            event.usage = {"prompt_tokens": len(state.prompt_ids), "completion_tokens": len(state.output_ids)}
            run.timing["step_s"] += time.perf_counter() - t0
            event.speculation = {**state.stats.summary(), **run.counters, **{
                f"coordinator_{name}": round(v, 4) for name, v in run.timing.items()},
                "num_draft_tokens": run.spec.num_draft_tokens,
                "adaptive_k": self.k_policy is not None and state.params.greedy,
                "k_steps": {str(n): c for n, c in sorted(run.k_used.items())},  # K drafted -> steps
                # accepted length -> [steps verified while pre-speculation ran, of those a branch matched]
                "prespec_by_accepted": {str(n): c for n, c in sorted(run.prespec_by_accepted.items())},
                "drafter": self.cfg.drafter.draft, "seed": state.params.seed,
                "queue_wait_s": round(run.queue_wait_s, 4)}
        self._persist(run, state, expected_step, committed, event)
        if not state.finished:
            run.timing["step_s"] += time.perf_counter() - t0
        metrics.record_step([k], [num_accepted], time.perf_counter() - t0)
        if k:
            metrics.record_draft_latency(t1 - t0)
        metrics.record_verify_latency(t2 - t1)
        tracing.annotate(k=k, accepted=num_accepted, emitted=len(verdict.tokens),
                         step_latency_ms=(time.perf_counter() - t0) * 1e3, draft_ms=(t1 - t0) * 1e3,
                         verify_ms=(t2 - t1) * 1e3, target=run.target, drafter=run.drafter)
        return event

    def _multi_step(self, run: _Run, state: RequestState) -> bool:
        """Whether the next steps go to the target worker as one multi-step call (`coordinator.steps_per_call`): the
        worker holds the request's cache, and nothing from elsewhere is needed between two passes (the worker's own
        head drafts, or the request drafts nothing)."""
        return (self.cfg.coordinator.steps_per_call > 1 and run.target_warm and run.target_handle is not None
                and state.remaining > 1
                and (self.head_in_target or run.spec.num_draft_tokens == 0 or not self.cfg.drafter.drafts))

    async def _steps(self, run: _Run, state: RequestState, queue: asyncio.Queue) -> None:
        """Steps of one multi-step call (`TargetWorker.verify_steps`), each committed and queued as its verdict
        arrives. K is chosen once for the call. Whatever the stream cannot handle (a lost or missing cache, a
        preempted slot, a lost worker) ends it; the next step then goes the one-call way, which recovers."""
        t0 = time.perf_counter()
        k = run.spec.num_draft_tokens if self.head_in_target else 0
        [want], adapt = draft_budgets([state], k, self.k_policy, max(self.active, 1))
        call = VerifyCall(request_id=state.request_id, start=state.length - 1, pending=state.last_token,
                          draft=Draft([]), params=state.params, step=state.step, epoch=run.epoch,
                          steps=self.cfg.coordinator.steps_per_call, remaining=state.remaining,
                          stop_ids=() if state.params.ignore_eos else state.eos_token_ids)
        if self.head_in_target:  # the call's K: the one chosen now, unless only the token budget capped it
            call.head_draft, call.draft_top_k = want, run.spec.draft_top_k
            call.head_k = want if want < state.remaining - 1 else k
        with tracing.span("coordinator.steps", parent=run.trace, step=state.step, steps=call.steps):
            stream = run.target_handle.verify_steps.options(num_returns="streaming").remote(call, _trace())
            run.counters["multi_step_calls"] += 1
            try:
                while not state.finished:
                    try:
                        verdict = await asyncio.wait_for(_next(stream), self.cfg.coordinator.verify_timeout_s)
                    except StopAsyncIteration:
                        return
                    except Exception as err:  # noqa: BLE001
                        if not is_actor_lost(err):
                            raise
                        self._target_lost(run)
                        return
                    if verdict == STALE:
                        raise _taken_over()
                    if verdict == PREEMPTED:  # queued again by the one-call step, which then replays
                        self._target_preempted(run)
                    if not isinstance(verdict, Verdict):  # CACHE_MISS: the one-call step resends the prefix
                        run.target_warm = False
                        return
                    t2 = time.perf_counter()
                    queue.put_nowait(self._committed(run, state, verdict, (t0, t0, t2), want, adapt, False))
                    t0 = t2
                    want = row_budget(call.head_k, state.remaining)
            finally:
                try:
                    ray.cancel(stream)  # a request that ended at a stop string, or failed: stop the worker's passes
                except Exception:  # noqa: BLE001 - already done
                    pass

    # -- drafting ----------------------------------------------------------------------------------------
    async def _draft(self, run: _Run, state: RequestState, want: int) -> tuple[Draft, Optional[Draft]]:
        """`want` drafts for the request's next step -> (the draft, the drafter's whole answer: maybe one token more,
        its guess of the bonus token, and the distributions pre-speculation ranks; None for prompt lookup). The
        hybrid rule (`pipeline.drafters.lookup_first`): prompt lookup first, the model elsewhere."""
        if self.lookup is not None:
            row = ProposeRow(state.request_id, state.context_view, want, state.params.greedy)
            found, _ = lookup_first(self.lookup, [row])
            if found[0] or self.drafters is None:
                if found[0] and self.drafters is not None:
                    await self._settle_predraft(run, state)  # a pre-draft for this step is not needed
                return Draft(found[0]), None
        if self.drafters is None:
            return Draft([]), None
        if self.head_on_drafter and run.drafter_base < 0 and (
                run.head_features is None or run.head_features.start > 0):
            # The drafter's head knows nothing of this request, and the states it needs are gone: a step without
            # drafts, whose verify call re-prefills the target to send them all.
            run.head_features, run.head_refeed = None, True
            return Draft([]), None
        length = state.length
        pre = run.pre
        if pre is not None and pre.step == state.step and pre.hit >= 0:
            run.pre = None
            try:
                got = await pre.task
            except Exception:  # noqa: BLE001 - a lost drafter: fall through to a fresh draft
                got = None
            if isinstance(got, list) and got[pre.hit] is not None:
                run.drafter_base = pre.base  # the pre-speculation call left the mirror at the committed context
                return got[pre.hit].head(want), got[pre.hit]
        await self._settle_predraft(run, state)
        extra = 1 if self._overlap_wanted(run, state.step + 1) and state.remaining - want > 2 else 0
        for _ in range(3):
            if run.drafter is None or run.drafter_handle is None:
                got = await self.drafters.pick()
                if got is None:
                    return Draft([]), None  # no drafter at all: a target-only step; picked again next step
                run.drafter, run.drafter_handle = got
                self.drafters.acquire(run.drafter)
                run.drafter_base = -1
                self._persist_fields(run, state.request_id, drafter_worker=run.drafter)
                try:  # a slot there (after the target's: no two requests wait for each other), waiting its turn
                    run.queue_wait_s += await run.drafter_handle.admit.remote(state.request_id)
                except Exception as err:  # noqa: BLE001
                    if not is_actor_lost(err):
                        raise
                    self._drafter_lost(run)
                    continue
            base = run.drafter_base if run.drafter_base >= 0 else 0
            call = ProposeCall(state.request_id, base, state.context_view[base:], want + extra, state.params,
                               state.step, run.spec.draft_top_k, run.epoch, features=run.head_features,
                               tree=self.trees)
            try:
                got = await asyncio.wait_for(_call(run.drafter_handle.propose, call),
                                             self.cfg.coordinator.draft_timeout_s)
            except Exception as err:  # noqa: BLE001
                if not is_actor_lost(err):
                    raise
                self._drafter_lost(run)
                continue
            if got == STALE:
                raise _taken_over()
            if got == CACHE_MISS:
                run.drafter_base = -1
                if self.head_on_drafter:  # its head lacks states: resent after the target's next prefill
                    run.head_features, run.head_refeed = None, True
                    return Draft([]), None
                continue
            run.drafter_base = length
            run.head_features = None  # the head has read them
            return got.head(want), got
        return Draft([]), None

    def _overlap_wanted(self, run: _Run, step: int) -> bool:
        """Pre-draft for `step`? Only while pre-drafts get used often enough: a wasted one costs drafter time
        the real draft then waits for. Requests where they rarely hit still probe now and then."""
        return self.prespec and (
            run.overlap_hit_rate >= OVERLAP_MIN_HIT_RATE or step % OVERLAP_PROBE_EVERY == 0)

    def _prespeculate(self, run: _Run, state: RequestState, draft: Draft, answer: Draft) -> None:
        """Ask the drafter now for step t+1 under the likeliest outcomes of step t (`pipeline.prespec`), all in one
        call: the branches the drafter's own probabilities rank highest, each drafting as many tokens as a fresh
        draft of its context would."""
        if run.drafter_handle is None or run.drafter_base < 0:
            return
        c = self.cfg.coordinator
        tails, nums = [], []
        for branch in rank_branches(answer.tokens, answer.top_ids, answer.top_probs, len(draft.tokens),
                                    c.prespec_branches, c.prespec_top_m):
            remaining = state.remaining - branch.num_accepted - 1
            want_next = min(run.spec.num_draft_tokens, remaining - 1)
            if want_next <= 0:
                continue
            extra = 1 if self._overlap_wanted(run, state.step + 2) and remaining - want_next > 2 else 0
            tails.append(branch.tail(draft.tokens))
            nums.append(want_next + extra)
        if not tails:
            return
        self._drop_predraft(run)
        base = run.drafter_base
        call = PrespecCall(state.request_id, base, state.context_view[base:], tails, nums, state.params,
                           state.step + 1, run.spec.draft_top_k, run.epoch)
        ref = run.drafter_handle.prespec.remote(call, _trace())
        task = asyncio.ensure_future(asyncio.wait_for(_await(ref), c.draft_timeout_s))
        run.pre = _PendingPropose(state.step + 1, state.length, tails, task, ref)
        run.counters["overlap_tries"] += 1

    async def _settle_predraft(self, run: _Run, state: RequestState) -> None:
        """Drop an unused pre-speculation. A greedy request's is cancelled. A sampled request's is awaited instead:
        whether a cancelled call had run would depend on timing, and the drafter's slot contents with it, which move
        the draft probabilities in their last bits (float32 sums of differently fed contexts); awaited, the drafter's
        state is a function of the request's outcomes alone, so a seeded request replays exactly."""
        pre = run.pre
        if pre is not None and not state.params.greedy:
            run.pre = None
            try:
                await pre.task
            except Exception:  # noqa: BLE001 - a lost drafter: the fresh draft finds out
                pass
        self._drop_predraft(run)

    def _drop_predraft(self, run: _Run) -> None:
        if run.pre is not None:
            if not run.pre.task.done():
                try:
                    ray.cancel(run.pre.ref)  # drops it from the drafter's queue if it has not run yet
                except Exception:  # noqa: BLE001
                    pass
            run.pre.task.cancel()
            run.pre.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved"
            run.pre = None

    def _drafter_lost(self, run: _Run) -> None:
        if run.drafter is not None:
            self.drafters.mark_dead(run.drafter)
        run.drafter, run.drafter_handle, run.drafter_base = None, None, -1
        run.counters["drafter_failovers"] += 1
        self._drop_predraft(run)

    # -- verification ------------------------------------------------------------------------------------
    async def _verify(self, run: _Run, call: VerifyCall, state: RequestState) -> Verdict:
        timeout = self.cfg.coordinator.verify_timeout_s
        for _ in range(4):
            if run.target_handle is None:  # failed over, resumed, or preempted: queue for a slot (never refused)
                before = run.target
                await self._admit(run, call.request_id, bounded=False)
                run.target_warm = run.maybe_warm and run.target == before  # a miss will tell otherwise
                run.maybe_warm = False
                self._persist_fields(run, call.request_id, target_worker=run.target)
            if not run.target_warm and call.prefix is None:
                call.prefix = state.context[:-1]
            try:
                verdict = await asyncio.wait_for(_call(run.target_handle.verify, call), timeout)
            except Exception as err:  # noqa: BLE001
                if not is_actor_lost(err):
                    raise
                self._target_lost(run)
                call.prefix = state.context[:-1]
                continue
            if verdict == STALE:
                raise _taken_over()
            if verdict == CACHE_MISS:
                run.counters["target_replays"] += 1
                call.prefix = state.context[:-1]
                continue
            if verdict == PREEMPTED:  # its slot was taken back under memory pressure: queue again, then replay
                self._target_preempted(run)
                call.prefix = state.context[:-1]
                continue
            run.target_warm = True
            return verdict
        raise APIError("the target replicas kept failing", 503, type="server_error", code="target_unavailable")

    def _target_lost(self, run: _Run) -> None:
        """The request's target worker died: the next call goes to another, which rebuilds the cache (prefill)."""
        self.targets.mark_dead(run.target)
        run.target, run.target_handle, run.target_warm = None, None, False
        run.counters["target_failovers"] += 1

    def _target_preempted(self, run: _Run) -> None:
        """The request's slot was taken back under memory pressure: it queues for one again, then replays."""
        run.counters["preemptions"] += 1
        self.targets.release(run.target)
        run.target_handle, run.target_warm = None, False

    async def _admit(self, run: _Run, rid: str, bounded: bool) -> None:
        """Hold a KV-cache slot on a target worker (-> run.target, run.target_handle): the preferred or least loaded
        one, waiting there in FIFO order while its slots are held. bounded: a worker whose queue is full answers
        QUEUE_FULL, and the next one is asked; when every one is full, HTTP 429."""
        t0 = time.monotonic()
        full: set[str] = set()
        lost = 0
        while True:
            if full:
                got = await self.targets.pick(exclude=frozenset(full))
            else:
                got = await self.targets.wait_pick(self.cfg.coordinator.replica_wait_s, prefer=run.target)
            if got is None and full:
                metrics.record_admission_rejection("request")
                raise APIError(f"all {len(full)} target replicas are busy and their queues are full; retry later",
                               429, type="rate_limit_error", code="queue_full")
            if got is None:
                raise APIError("no target replica is available", 503, type="server_error", code="no_target_replica")
            name, handle = got
            run.target, run.target_handle = name, handle  # set while queued: an abandon releases the place too
            self.targets.acquire(name)
            try:
                answer = await handle.admit.remote(rid, bounded)
            except asyncio.CancelledError:
                handle.release.remote([rid], run.epoch)  # gave up waiting (client gone): leave the queue
                self.targets.release(name)
                run.target_handle = None
                raise
            except Exception as err:  # noqa: BLE001
                self.targets.release(name)
                run.target_handle = None
                if not is_actor_lost(err):
                    raise
                self.targets.mark_dead(name)
                lost += 1
                if lost > 4:
                    raise APIError("the target replicas kept failing", 503, type="server_error",
                                   code="target_unavailable") from err
                continue
            if answer == QUEUE_FULL:
                self.targets.release(name)
                run.target_handle = None
                full.add(name)
                continue
            run.queue_wait_s += time.monotonic() - t0
            return

    # -- persistence ---------------------------------------------------------------------------------------
    def _persist(self, run: _Run, state: RequestState, expected_step: int, committed: list[int],
                 event: StepEvent) -> None:
        d = state.to_dict()
        args = (state.request_id, self.owner, expected_step, state.step, committed, d["emitted_chars"],
                state.finish_reason, d["stats"], event.to_json())
        self._chain(run, lambda: self.store.commit(*args))

    def _persist_fields(self, run: _Run, rid: str, **fields: Any) -> None:
        self._chain(run, lambda: self.store.set_fields(rid, self.owner, **fields))

    def _chain(self, run: _Run, make) -> None:
        prev = run.persist

        async def after_prev() -> None:
            if prev is not None:
                await prev  # NotOwner propagates: later writes must not happen either
            if run.persist_broken:
                return
            try:
                await make()
            except NotOwner:
                raise
            except Exception as err:  # noqa: BLE001 - Redis trouble must not kill the stream
                if not run.persist_broken:
                    logger.warning("persisting failed, the request will not be resumable: %r", err)
                run.persist_broken = True

        run.persist = asyncio.ensure_future(after_prev())

    async def _flush(self, run: _Run) -> None:
        if run.persist is not None:
            try:
                await run.persist
            except NotOwner:
                pass

    async def _abandon(self, run: _Run, state: RequestState) -> None:
        # The slots go back first: the writes below wait on Redis, which may be slow or being replaced, and a request
        # resumed later re-prefills wherever it lands.
        self._release(run, state.request_id)
        try:
            await self._flush(run)
            await self.store.set_fields(state.request_id, self.owner, status="cancelled")
        except Exception:  # noqa: BLE001 - taken over, or Redis gone: nothing to mark
            pass

    def _release(self, run: _Run, rid: str) -> None:
        """Give the request's slots (or places in their queues) back; once: the handles are dropped."""
        self._drop_predraft(run)
        if run.target_handle is not None:
            self.targets.release(run.target)
            run.target_handle.release.remote([rid], run.epoch)
            run.target_handle = None
        if run.drafter_handle is not None:
            self.drafters.release(run.drafter)
            run.drafter_handle.release.remote([rid], run.epoch)
            run.drafter_handle = None

    def _gauge(self) -> None:
        metrics.set_active_requests(self.active)

    async def check_health(self) -> None:
        await asyncio.wait_for(self.store.ping(), 25.0)  # reconnects to a Redis that restarted (new port too)


_END = "end"  # queue sentinel: the request finished
OVERLAP_MIN_HIT_RATE = 0.25  # pre-draft while at least this share of pre-drafts is used
OVERLAP_PROBE_EVERY = 8  # else try one every this many steps


async def _guard(events: AsyncIterator[list[StepEvent]]) -> AsyncIterator[list[StepEvent | ErrorEvent]]:
    try:
        async for event in events:
            yield event
    except APIError as err:
        yield [_error_event(err)]
    except NotOwner:
        yield [_error_event(APIError("this request was taken over by another stream", 409, code="taken_over"))]
    except Exception as err:  # noqa: BLE001 - a bug must reach the client as an error, not as a lost replica
        logger.exception("request loop failed")
        yield [_error_event(APIError(f"internal error: {type(err).__name__}: {err}", 500, "internal_error",
                                     code="internal_error"))]


def _taken_over() -> APIError:
    """Another coordinator owns the request now (its client resumed elsewhere, or this one was thought lost)."""
    return APIError("this request was taken over by another stream", 409, code="taken_over")


def _error_event(err: APIError) -> ErrorEvent:
    return ErrorEvent(err.body()["error"], err.status)


def _trace() -> Optional[dict]:
    return tracing.inject() or None


async def _await(ref) -> Any:
    return await ref


async def _next(stream) -> Any:
    """The next answer of a streaming actor call (StopAsyncIteration after its last)."""
    return await (await stream.__anext__())


async def _call(method, row) -> Any:
    """One direct actor call, awaited (an ObjectRef is awaitable on the event loop)."""
    with tracing.span(f"call {getattr(method, '_method_name', 'actor')}", request_id=row.request_id):
        return await method.remote(row, _trace())
