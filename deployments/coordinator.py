"""The coordinator: runs each request's loop  draft -> verify -> accept -> commit -> persist -> stream.

One Serve deployment; each replica runs many request loops concurrently on its event loop. The hot loop
calls the drafter and target *worker actors* directly (see workers.py); a request sticks to one target
worker (its KV cache) and one drafter worker while they live.

Per step (step t of a request with committed context C_t, last token "pending"):
1. draft: K tokens from the drafter worker (or prompt lookup, in-process). With overlap on, the drafter is
   asked for K+1 tokens: the last is its guess of the bonus token.
2. verify: one call to the target worker (batched there with other requests' calls); while it runs, the
   drafter already drafts step t+1 from C_t + draft + guess (optimistic: it is used only if all K were
   accepted and the bonus token equals the guess, else discarded).
3. accept (`pipeline.rejection.accept`, uniforms from (seed, step)), commit to the RequestState.
4. persist the step to Redis *asynchronously* (ordered per request, fenced by owner and step; not on the
   critical path: a step lost in a crash is regenerated identically from (seed, step)), and yield it.
Failures: a lost drafter -> another drafter, else target-only steps; a lost target -> another target,
rebuilt from the committed token ids (prefill); a cache miss -> the same with the prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from pipeline.rejection import accept_row
from deployments.config import DRAFTER, TARGET, AppConfig
from deployments.drafter_replica import ProposeRow
from deployments.protocol import APIError
from deployments.redis_state import NotOwner, RequestStore, redis_url_getter
from deployments.target_replica import VerifyRow
from deployments.workers import CACHE_MISS, WorkerPool, is_actor_lost

logger = logging.getLogger(__name__)

from deployments import metrics, tracing  # ops hooks: tracing is a no-op unless OTEL_EXPORTER_OTLP_ENDPOINT is set


@dataclass
class Draft:
    tokens: list[int]  # d_0..d_{K-1}
    top_ids: Any = None  # [K, k] int64 array or None (point masses)
    top_probs: Any = None
    guess: Optional[int] = None  # the drafter's guess of the bonus token (overlap)


@dataclass
class _PreDraft:
    """A draft for step `step` requested optimistically, valid only if the context is `context_len` long
    and ends with `tail`."""

    step: int
    context_len: int
    tail: list[int]
    task: asyncio.Task
    base_after: int  # the drafter's mirrored committed length if the pre-draft is used
    ref: Any = None  # the Ray call, cancelled in the drafter when the pre-draft is dropped


@dataclass
class _Run:
    """Mutable per-request loop state (never persisted: everything here can be rebuilt)."""

    spec_k: int
    draft_top_k: int
    target: Optional[str] = None
    target_handle: Any = None
    target_warm: bool = False  # the target worker holds this request's committed tokens
    maybe_warm: bool = False  # resumed: `target` may still hold them (tried without a prefix first)
    drafter: Optional[str] = None
    drafter_handle: Any = None
    drafter_base: int = -1  # committed context length the drafter worker mirrors; -1: nothing
    pre: Optional[_PreDraft] = None
    persist: Optional[asyncio.Task] = None
    persist_broken: bool = False
    overlap_hit_rate: float = 1.0  # running estimate of how often a pre-draft is used (optimistic start)
    steps: int = 0  # steps this loop ran (its first one also prefills the target: not a measure of K's cost)
    k_used: dict[int, int] = field(default_factory=dict)  # K of this request's steps -> count
    timing: dict[str, float] = field(default_factory=lambda: {"draft_s": 0.0, "verify_s": 0.0, "step_s": 0.0})
    trace: Optional[dict] = None  # W3C context of this request's coordinator span (deployments.tracing)
    counters: dict[str, int] = field(default_factory=lambda: {
        "overlap_tries": 0, "overlap_hits": 0, "target_replays": 0, "target_failovers": 0,
        "drafter_failovers": 0, "steps_without_draft": 0})


class Coordinator:
    async def __init__(self, config: dict[str, Any], target: Any, drafter: Any = None, redis: Any = None) -> None:
        import torch
        from ray import serve

        torch.set_num_threads(1)
        self.cfg = AppConfig.model_validate(config)
        self.info = await target.info.remote()  # waits until a target replica is up
        self.store = await RequestStore.connect(redis_url_getter(self.cfg, redis), self.cfg.redis_namespace,
                                                self.cfg.request_ttl_s)
        from pipeline.models.loader import load_tokenizer

        self.tokenizer = load_tokenizer(self.info["path"])
        ctx = serve.get_replica_context()
        self.targets = WorkerPool(ctx.app_name, TARGET)
        method = self.cfg.drafter.method
        self.drafters = WorkerPool(ctx.app_name, DRAFTER) if self.cfg.drafter.uses_model else None
        self.local_drafter = None
        if method in ("prompt_lookup", "hybrid"):
            from pipeline.drafters import PromptLookupDrafter, hybrid_lookup

            self.local_drafter = PromptLookupDrafter() if method == "prompt_lookup" else hybrid_lookup()
        self.owner = f"{ctx.replica_id.unique_id}:{uuid.uuid4().hex[:8]}"
        self.active = 0
        # Abandon tasks (mark a request cancelled, free its slots) run after their stream is gone: the loop keeps
        # only weak references to tasks, so one nobody holds can be collected before it finishes.
        self._abandoning: set[asyncio.Task] = set()
        self.k_policy = None  # one per coordinator, over its requests; bucketed by how many it is serving
        if self.cfg.coordinator.adaptive_k and method != "none":
            from pipeline.adaptive import AdaptiveK

            self.k_policy = AdaptiveK(max_k=64)

    async def model_info(self) -> dict[str, Any]:
        return {**self.info, "drafter": self.cfg.drafter.method, "has_tokenizer": self.tokenizer is not None}

    # -- entry points (Serve streaming calls) ----------------------------------------------------------
    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Start a request: {"request_id", "kind", "model", "created", "prompt_ids", "params", "spec"}.
        Yields lists of per-step events {"i", "ids", "text", "finish"[, "usage", "speculation"]}, or one
        {"error", "status"} event (errors travel as data: the ingress tells them from a lost replica)."""
        async for events in _guard(self._generate(request)):
            yield events

    async def resume(self, request_id: str, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """Take a request over (its coordinator died, or its client reconnects) and stream the events after
        index `after`: first those already in Redis, then newly generated ones."""
        async for events in _guard(self._resume(request_id, after)):
            yield events

    async def _generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from pipeline.config import SamplingParams
        from pipeline.sequence import RequestState

        p = request["params"]
        state = RequestState(
            request_id=request["request_id"], prompt_ids=list(request["prompt_ids"]),
            params=SamplingParams(**{**p, "stop": tuple(p.get("stop") or ())}),
            eos_token_ids=tuple(self.info["eos_token_ids"]),
        )
        if self.tokenizer is not None:
            state.attach_tokenizer(self.tokenizer)
        with tracing.span("coordinator.admit", parent=request.get("trace"), request_id=state.request_id):
            await self.store.create(state.request_id, self.owner, state.to_dict(), kind=request["kind"],
                                    model=request["model"], created=request["created"], spec=request["spec"])
        async for events in self._loop(state, request["spec"], prefer_target=None, trace=request.get("trace")):
            yield events

    async def _resume(self, request_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        from pipeline.sequence import RequestState

        stored = await self.store.take_over(request_id, self.owner)
        if stored is None:
            raise APIError(f"unknown or expired request id {request_id!r}", 404, param="Last-Event-ID",
                           code="request_not_found")
        old = await self.store.events(request_id, after + 1)
        if old:
            yield old
        if stored.finished:
            return
        state = RequestState.from_dict(stored.state_dict(), self.tokenizer)
        async for events in self._loop(state, stored.json("spec"), prefer_target=stored.fields.get("target_worker")):
            events = [e for e in events if e["i"] > after]
            if events:
                yield events

    # -- the loop --------------------------------------------------------------------------------------
    async def _loop(self, state, spec: dict[str, Any], prefer_target: Optional[str],
                    trace: Optional[dict] = None) -> AsyncIterator[list[dict]]:
        run = _Run(spec_k=int(spec["num_draft_tokens"]), draft_top_k=int(spec["draft_top_k"]))
        run.target, run.maybe_warm = prefer_target, prefer_target is not None
        # Not made current: it spans the generator's yields. Steps name it as their parent via run.trace.
        span = tracing.start_span("coordinator.request", parent=trace, request_id=state.request_id,
                                  k=run.spec_k, coordinator=self.owner, resumed=prefer_target is not None)
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
                events = [it for it in items if isinstance(it, dict)]
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
                        raise APIError("this request was taken over by another stream", 409, code="taken_over")
                queue.put_nowait(await self._step(run, state))
            await self._flush(run)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - re-raised by the consumer side
            queue.put_nowait(err)

    async def _step(self, run: _Run, state) -> dict[str, Any]:
        with tracing.span("coordinator.step", parent=run.trace, step=state.step):
            return await self._step_body(run, state)

    async def _step_body(self, run: _Run, state) -> dict[str, Any]:
        t0 = time.perf_counter()
        ctx = state.context
        want = min(run.spec_k, state.remaining - 1)
        adapt = self.k_policy is not None and want > 0 and state.params.greedy
        if adapt:
            want = self.k_policy.choose(max(self.active, 1), want)
        draft = await self._draft(run, state, want) if want > 0 else Draft([])
        t1 = time.perf_counter()
        row = VerifyRow(
            request_id=state.request_id, start=len(ctx) - 1, tokens=[ctx[-1], *draft.tokens],
            params=state.params, step=state.step, top_ids=draft.top_ids, top_probs=draft.top_probs,
        )
        verify_task = asyncio.ensure_future(self._verify(run, row, ctx))
        if draft.guess is not None and self._overlap_wanted(run, state.step + 1):
            self._predraft(run, state, draft)
        predrafted = run.pre is not None
        try:
            verdict = await verify_task
        except BaseException:
            verify_task.cancel()
            raise
        t2 = time.perf_counter()
        run.timing["draft_s"] += t1 - t0
        run.timing["verify_s"] += t2 - t1
        num_accepted, emitted = accept_row(verdict["accept_probs"], verdict["target_tokens"], draft.tokens,
                                           state.params.seed, state.step)
        expected_step = state.step
        committed, text = state.commit(emitted, len(draft.tokens), num_accepted)
        run.steps += 1
        run.k_used[len(draft.tokens)] = run.k_used.get(len(draft.tokens), 0) + 1
        if adapt:
            self.k_policy.observe(max(self.active, 1), len(draft.tokens), time.perf_counter() - t0,
                                  [len(draft.tokens)], [num_accepted], timed=run.steps > 1)
        if run.pre is not None and not (
            not state.finished and run.pre.step == state.step and run.pre.context_len == state.length
            and state.context[-len(run.pre.tail):] == run.pre.tail
        ):
            self._drop_predraft(run)
        if predrafted:
            run.overlap_hit_rate = 0.7 * run.overlap_hit_rate + 0.3 * (run.pre is not None)
        if want > 0 and not draft.tokens:
            run.counters["steps_without_draft"] += 1  # no drafter reachable, or prompt lookup found nothing
        event: dict[str, Any] = {"i": expected_step, "ids": committed, "text": text, "finish": state.finish_reason}
        if state.finished:
            event["usage"] = {"prompt_tokens": len(state.prompt_ids), "completion_tokens": len(state.output_ids)}
            run.timing["step_s"] += time.perf_counter() - t0
            event["speculation"] = {**state.stats.summary(), **run.counters, **{
                f"coordinator_{k}": round(v, 4) for k, v in run.timing.items()}, "num_draft_tokens": run.spec_k,
                "adaptive_k": self.k_policy is not None and state.params.greedy,
                "k_steps": {str(k): n for k, n in sorted(run.k_used.items())},  # K drafted -> steps
                "drafter": self.cfg.drafter.method, "seed": state.params.seed}
        self._persist(run, state, expected_step, committed, event)
        if not state.finished:
            run.timing["step_s"] += time.perf_counter() - t0
        if metrics is not None:
            metrics.record_step([len(draft.tokens)], [num_accepted], time.perf_counter() - t0)
            if draft.tokens:
                metrics.record_draft_latency(t1 - t0)
            metrics.record_verify_latency(t2 - t1)
        tracing.annotate(k=len(draft.tokens), accepted=num_accepted, emitted=len(emitted),
                         step_latency_ms=(time.perf_counter() - t0) * 1e3, draft_ms=(t1 - t0) * 1e3,
                         verify_ms=(t2 - t1) * 1e3, target=run.target, drafter=run.drafter)
        return event

    # -- drafting ----------------------------------------------------------------------------------------
    async def _draft(self, run: _Run, state, want: int) -> Draft:
        if self.local_drafter is not None:  # prompt lookup, alone or before the model (hybrid)
            found = self.local_drafter.lookup(state.context, want, key=state.request_id)
            if found or self.drafters is None:
                if found and self.drafters is not None:
                    self._drop_predraft(run)  # a pre-draft for this step is not needed
                return Draft(found)
        if self.drafters is None:
            return Draft([])
        ctx = state.context
        pre = run.pre
        if pre is not None and pre.step == state.step and pre.context_len == len(ctx):
            run.pre = None
            try:
                got = await pre.task
            except Exception:  # noqa: BLE001 - a lost drafter: fall through to a fresh draft
                got = None
            if got is not None and got != CACHE_MISS:
                run.counters["overlap_hits"] += 1
                run.drafter_base = pre.base_after
                return self._to_draft(got, want)
        self._drop_predraft(run)
        extra = 1 if self._overlap_wanted(run, state.step + 1) and state.remaining - want > 2 else 0
        for _ in range(3):
            if run.drafter is None or run.drafter_handle is None:
                got = await self.drafters.pick()
                if got is None:
                    return Draft([])  # no drafter at all: a target-only step; picked again next step
                run.drafter, run.drafter_handle = got
                self.drafters.acquire(run.drafter)
                run.drafter_base = -1
                self._persist_fields(run, state.request_id, drafter_worker=run.drafter)
            base = run.drafter_base if run.drafter_base >= 0 else 0
            row = ProposeRow(state.request_id, base, ctx[base:], want + extra, state.params, state.step,
                             run.draft_top_k)
            try:
                got = await asyncio.wait_for(_call(run.drafter_handle.propose, row),
                                             self.cfg.coordinator.draft_timeout_s)
            except Exception as err:  # noqa: BLE001
                if not is_actor_lost(err):
                    raise
                self._drafter_lost(run)
                continue
            if got == CACHE_MISS:
                run.drafter_base = -1
                continue
            run.drafter_base = len(ctx)
            return self._to_draft(got, want)
        return Draft([])

    def _to_draft(self, got: dict[str, Any], want: int) -> Draft:
        tokens = got["token_ids"]
        guess = tokens[want] if len(tokens) > want else None
        return Draft(tokens[:want], got["top_ids"][:want], got["top_probs"][:want], guess)

    def _overlap_wanted(self, run: _Run, step: int) -> bool:
        """Pre-draft for `step`? Only while pre-drafts get used often enough: a wasted one costs drafter time
        the real draft then waits for. Requests where they rarely hit still probe now and then."""
        return self.cfg.coordinator.overlap and (
            run.overlap_hit_rate >= OVERLAP_MIN_HIT_RATE or step % OVERLAP_PROBE_EVERY == 0)

    def _predraft(self, run: _Run, state, draft: Draft) -> None:
        """Ask the drafter now for step t+1, assuming every draft token and the guessed bonus are accepted."""
        if run.drafter_handle is None:
            return
        assumed_remaining = state.remaining - len(draft.tokens) - 1
        want_next = min(run.spec_k, assumed_remaining - 1)
        if want_next <= 0:
            return
        extra = 1 if self._overlap_wanted(run, state.step + 2) and assumed_remaining - want_next > 2 else 0
        tail = [*draft.tokens, draft.guess]
        ctx_len = state.length
        row = ProposeRow(state.request_id, ctx_len, tail, want_next + extra, state.params, state.step + 1,
                         run.draft_top_k)
        ref = run.drafter_handle.propose.remote(row, _trace())
        task = asyncio.ensure_future(asyncio.wait_for(_await(ref), self.cfg.coordinator.draft_timeout_s))
        run.pre = _PreDraft(state.step + 1, ctx_len + len(tail), tail, task, ctx_len + len(tail), ref)
        run.counters["overlap_tries"] += 1

    def _drop_predraft(self, run: _Run) -> None:
        if run.pre is not None:
            if not run.pre.task.done():
                try:
                    import ray

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
    async def _verify(self, run: _Run, row: VerifyRow, ctx: list[int]) -> dict[str, Any]:
        timeout = self.cfg.coordinator.verify_timeout_s
        for _ in range(4):
            if run.target_handle is None:
                got = await self.targets.wait_pick(self.cfg.coordinator.replica_wait_s, prefer=run.target)
                if got is None:
                    raise APIError("no target replica is available", 503, type="server_error",
                                   code="no_target_replica")
                hoped = run.maybe_warm and got[0] == run.target
                run.maybe_warm = False
                run.target, run.target_handle = got
                run.target_warm = hoped  # a miss will tell otherwise
                self.targets.acquire(run.target)
                self._persist_fields(run, row.request_id, target_worker=run.target)
            if not run.target_warm and row.prefix is None:
                row.prefix = ctx[:-1]
            try:
                verdict = await asyncio.wait_for(_call(run.target_handle.verify, row), timeout)
            except Exception as err:  # noqa: BLE001
                if not is_actor_lost(err):
                    raise
                self.targets.mark_dead(run.target)
                run.target, run.target_handle, run.target_warm = None, None, False
                run.counters["target_failovers"] += 1
                row.prefix = ctx[:-1]
                continue
            if verdict == CACHE_MISS:
                run.counters["target_replays"] += 1
                row.prefix = ctx[:-1]
                continue
            run.target_warm = True
            return verdict
        raise APIError("the target replicas kept failing", 503, type="server_error", code="target_unavailable")

    # -- persistence ---------------------------------------------------------------------------------------
    def _persist(self, run: _Run, state, expected_step: int, committed: list[int], event: dict) -> None:
        d = state.to_dict()
        args = (state.request_id, self.owner, expected_step, state.step, committed, d["emitted_chars"],
                state.finish_reason, d["stats"], event)
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

    async def _abandon(self, run: _Run, state) -> None:
        self._drop_predraft(run)
        try:
            await self._flush(run)
            await self.store.set_fields(state.request_id, self.owner, status="cancelled")
        except Exception:  # noqa: BLE001 - taken over, or Redis gone: nothing to mark
            pass
        self._release(run, state.request_id)

    def _release(self, run: _Run, rid: str) -> None:
        self._drop_predraft(run)
        if run.target_handle is not None:
            self.targets.release(run.target)
            run.target_handle.release.remote([rid])
        if run.drafter_handle is not None:
            self.drafters.release(run.drafter)
            run.drafter_handle.release.remote([rid])

    def _gauge(self) -> None:
        if metrics is not None:
            metrics.set_active_requests(self.active)

    async def check_health(self) -> None:
        await asyncio.wait_for(self.store.client.ping(), 10.0)


_END = "end"  # queue sentinel: the request finished
OVERLAP_MIN_HIT_RATE = 0.25  # pre-draft while at least this share of pre-drafts is used
OVERLAP_PROBE_EVERY = 8  # else try one every this many steps


async def _guard(events: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[list[dict[str, Any]]]:
    try:
        async for event in events:
            yield event
    except APIError as err:
        yield [{**err.body(), "status": err.status}]
    except NotOwner:
        yield [{**APIError("this request was taken over by another stream", 409, code="taken_over").body(),
                "status": 409}]
    except Exception as err:  # noqa: BLE001 - a bug must reach the client as an error, not as a lost replica
        logger.exception("request loop failed")
        yield [{**APIError(f"internal error: {type(err).__name__}: {err}", 500, "internal_error",
                           code="internal_error").body(), "status": 500}]


def _trace() -> Optional[dict]:
    return (tracing.inject() or None) if tracing is not None else None


async def _await(ref) -> Any:
    return await ref


async def _call(method, row) -> Any:
    """One direct actor call, awaited (an ObjectRef is awaitable on the event loop)."""
    with tracing.span(f"call {getattr(method, '_method_name', 'actor')}", request_id=row.request_id):
        return await method.remote(row, _trace())
