"""One speculative step, two paths: a request through the in-process engine and through the Serve app (real Ray,
real Redis) gives the same events, step by step, and the same output.

Both paths run the pieces of `pipeline.step` with the same tiny target and drafter: prompt lookup where the context
repeats, the model drafter elsewhere (`lookup+MODEL`; the model part runs on a drafter replica in Serve), a fixed
K (the adaptive policy off, so both take the same K every step), greedy and seeded-sampled. A first test drives the
Serve workers' classes by hand (no Ray), the way the coordinator does; the second runs the whole app.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.serve import run_app, sse_events, tiny_engine

APP = "onestep"
MODEL = "tiny-llama"
MAX_SEQ_LEN = 256
K = 3


SAMPLING = [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}]
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 40, 50, 60]  # repeats (prompt lookup drafts) and fresh (the model drafts)


@pytest.fixture(scope="module")
def server(tiny_models):
    from ray import serve

    from deployments.app import build_app

    config = {
        "served_model_name": MODEL,
        "target": {"model": str(tiny_models["llama"]), "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 4},
        "drafter": {"draft": "lookup+" + str(tiny_models["draft"])},
        "coordinator": {"adaptive_k": False},
        "speculation": {"num_draft_tokens": K},
    }
    url = run_app(build_app(config), APP)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return tiny_engine(tiny_models, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, hybrid=True)


def serve_events(server: str, body: dict) -> tuple[list[list[int]], dict]:
    """Token ids of each step event, and the final usage chunk."""
    steps, final = [], None
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for _, data in sse_events(r.iter_lines()):
            if data == "[DONE]":
                break
            assert "error" not in data, data
            if data["choices"]:
                steps.append(data["choices"][0]["token_ids"])
            else:
                final = data
    return steps, final


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
