"""One speculative step, two paths: a request through the in-process engine and through the Serve app (real Ray,
real Redis) gives the same events, step by step, and the same output.

Both paths run the pieces of `pipeline.step` with the same tiny target and drafter: prompt lookup where the context
repeats, the model drafter elsewhere (`lookup+MODEL`; the model part runs on a drafter replica in Serve), a fixed
K (the adaptive policy off, so both take the same K every step), greedy and seeded-sampled. A first test drives the
Serve workers' classes by hand (no Ray), the way the coordinator does; the second runs the whole app.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serve import stream_steps, tiny_engine
from tests.support.small_app import MODEL, K, delete_small_app, small_app

MAX_SEQ_LEN = 256  # the worker classes driven by hand and the engine
SAMPLING = [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}]
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 40, 50, 60]  # repeats (prompt lookup drafts) and fresh (the model drafts)


@pytest.fixture(scope="module")
def server(tiny_models):
    """The app of tests/support/small_app.py (the admission tests' too); this module is its last user."""
    yield small_app(tiny_models)
    delete_small_app()


@pytest.fixture(scope="module")
def engine(tiny_models):
    return tiny_engine(tiny_models, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, hybrid=True)


def serve_events(server: str, body: dict) -> tuple[list[list[int]], dict]:
    """Token ids of each step event, and the final usage chunk."""
    return stream_steps(server, body)


def engine_steps(engine, sampling: dict):
    """The engine's events for PROMPT (checking that both drafters ran), and its result."""
    from pipeline.config import SamplingParams, SpecParams

    before = engine.drafter.lookup_rows, engine.drafter.model_rows
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, **sampling), SpecParams(K)))
    assert engine.drafter.lookup_rows > before[0] and engine.drafter.model_rows > before[1]  # both drafters ran
    return [e.token_ids for e in events], events[-1].result


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_serve_workers_run_the_engines_steps(tiny_models, engine, sampling):
    """The coordinator's loop in miniature over the worker classes: lookup first in-process, the model on the
    drafter worker (asked for one more token, as with overlap on), verify and accept on the target worker."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from pipeline.config import SamplingParams
    from pipeline.drafters import ProposeRow, lookup_first, lookup_part
    from pipeline.sequence import RequestState
    from pipeline.step import Draft, commit, draft_budgets

    want_steps, result = engine_steps(engine, sampling)
    target = TargetWorker(str(tiny_models["llama"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    drafter = DrafterWorker(str(tiny_models["draft"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    lookup = lookup_part("lookup+" + str(tiny_models["draft"]))
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"seed": result.seed, **sampling})
    state = RequestState("r", list(PROMPT), params)
    for worker in (target, drafter):  # a slot on each, as the coordinator takes them before the first step
        asyncio.run(worker.admit(state.request_id))
    steps, base = [], 0
    while not state.finished:
        [want], _ = draft_budgets([state], K)
        draft = Draft([])
        if want:
            found, to_model = lookup_first(lookup, [ProposeRow(state.request_id, state.context_view, want)])
            if to_model:
                got = drafter._run_batch([ProposeCall(state.request_id, base, state.context[base:], want + 1, params,
                                                      state.step, 64)])[0]
                draft, base = got.head(want), state.length
            else:
                draft = Draft(found[0])
        call = VerifyCall(state.request_id, state.length - 1, state.last_token, draft, params, state.step,
                          prefix=None if steps else state.context[:-1])
        steps.append(commit(state, target._run_batch([call])[0])[0])
    assert steps == want_steps
    assert state.output_ids == result.token_ids


def test_calls_of_a_coordinator_that_lost_the_request_change_nothing(tiny_models):
    """A coordinator that dies, or loses its request to another (a client resumed elsewhere), leaves calls behind:
    queued in a worker or still on the way. Run after the new owner's calls (a higher ownership epoch), they are
    refused (STALE) and change nothing: the drafter's mirror of the context (a stale pre-draft carries a guess the new
    owner never made), the drafts that follow, the target's cache; the old owner's release frees nothing."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from deployments.workers import STALE
    from pipeline.config import SamplingParams
    from pipeline.step import Draft

    params = SamplingParams(temperature=0.9, seed=11, max_tokens=64, ignore_eos=True)
    ctx = [7, 19, 3, 88, 41, 5, 60, 2]
    drafter = DrafterWorker(str(tiny_models["draft"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    target = TargetWorker(str(tiny_models["llama"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    for worker in (target, drafter):
        asyncio.run(worker.admit("r"))

    def propose(worker, base, new, step, epoch):
        return worker._run_batch([ProposeCall("r", base, new, K, params, step, 64, epoch=epoch)])[0]

    def verify(worker, context, draft, step, epoch, prefix=False):
        call = VerifyCall("r", len(context) - 1, context[-1], draft, params, step,
                          prefix=context[:-1] if prefix else None, epoch=epoch)
        return worker._run_batch([call])[0]

    first = propose(drafter, 0, ctx, 0, epoch=1)  # the first owner drafts step 0, then dies
    verdict = verify(target, ctx, first, 0, epoch=2, prefix=True)  # the new owner's step 0
    assert propose(drafter, 0, ctx, 0, epoch=2).tokens == first.tokens
    # The dead owner's pre-draft for step 1 (its draft plus a guessed bonus token) and its verify arrive late.
    assert propose(drafter, len(ctx), [*first.tokens, 99], 1, epoch=1) == STALE
    assert drafter._ctx["r"] == ctx
    assert verify(target, ctx, Draft([99, 98, 97]), 0, epoch=1) == STALE
    # The new owner's next step drafts what a drafter that never saw the stale call drafts, and verifies the same.
    ctx1 = ctx + verdict.tokens
    fresh = DrafterWorker(str(tiny_models["draft"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    asyncio.run(fresh.admit("r"))
    want = propose(fresh, 0, ctx1, 1, epoch=1)
    got = propose(drafter, len(ctx), verdict.tokens, 1, epoch=2)
    assert got.tokens == want.tokens
    clean = TargetWorker(str(tiny_models["llama"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    asyncio.run(clean.admit("r"))
    assert verify(target, ctx1, got, 1, epoch=2).tokens == verify(clean, ctx1, got, 1, epoch=1, prefix=True).tokens
    # The old owner's release is ignored; the owner's frees the slots.
    for worker in (drafter, target):
        asyncio.run(worker.release(["r"], 1))
        assert worker.slots.slot_of("r") is not None
        asyncio.run(worker.release(["r"], 2))
        assert worker.slots.slot_of("r") is None
    assert "r" not in drafter._ctx and "r" not in target._fed


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_engine_and_serve_run_the_same_steps(server, engine, sampling):
    want_steps, result = engine_steps(engine, sampling)
    steps, final = serve_events(server, {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True,
                                         "stream": True, **sampling})
    assert steps == want_steps  # step by step: the same drafts, verdicts and commits
    assert [t for s in steps for t in s] == result.token_ids
    spec = final["speculation"]
    for name in ("drafted", "accepted", "target_passes", "generated"):
        assert spec[name] == result.stats[name], name
    if "seed" in sampling:
        assert spec["seed"] == result.seed == sampling["seed"]
