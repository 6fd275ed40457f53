"""Pre-speculation (`pipeline.prespec`, `Coordinator._prespeculate`, `DrafterWorker.prespec`): while a step is
verified, the drafter drafts the next one for the likeliest outcomes; a hit makes the draft ready, a miss changes
nothing.

The first test drives the worker classes by hand (no Ray), the coordinator's loop in miniature, against the
in-process engine: the same steps, greedy and seeded, with a drafter that misses (the tiny random draft model) and
one that hits (the target drafting for itself). The others run the whole app (real Ray, real Redis): every step of a
greedy request whose drafter is the target hits, and the hits are counted by accepted length; a seeded request
replays exactly and matches the engine.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serve import run_app, stream_completion

APP = "prespec"
MODEL = "tiny-prespec"
MAX_SEQ_LEN = 256
K = 3
BRANCHES = 2 * (K + 1)  # with top_m = 2: every accepted length's two likeliest next tokens
PROMPT = [7, 19, 3, 88, 41, 5, 60, 2]
SAMPLING = [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}]


def engine_for(tiny_models, drafter: str):
    from pipeline.config import EngineConfig
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    target, _ = load_model(str(tiny_models["llama"]))
    draft, _ = load_model(str(tiny_models[drafter]))
    return SpeculativeEngine(target, None, ModelDrafter(draft), EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ_LEN))


def engine_run(engine, sampling: dict, max_tokens: int = 40):
    from pipeline.config import SamplingParams, SpecParams

    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                                SpecParams(K)))
    return [e.token_ids for e in events], events[-1].result


@pytest.mark.parametrize("drafter", ["draft", "llama"], ids=["misses", "self-draft"])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_workers_with_prespeculation_run_the_engines_steps(tiny_models, drafter, sampling):
    """Each step: the draft (a pre-speculated branch's if the last verdict matched one, else a fresh propose call),
    then the pre-speculation call for the next step, then verify and accept. The steps are the engine's, hit or
    miss; the hits are the steps whose outcome was a branch."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import PrespecCall, ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from pipeline.config import SamplingParams
    from pipeline.prespec import match_branch, rank_branches
    from pipeline.sequence import RequestState
    from pipeline.step import commit, draft_budgets

    want_steps, result = engine_run(engine_for(tiny_models, drafter), sampling)
    target = TargetWorker(str(tiny_models["llama"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    worker = DrafterWorker(str(tiny_models[drafter]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
                           prespec_branches=BRANCHES)
    assert worker.branches == BRANCHES
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"seed": result.seed, **sampling})
    state = RequestState("r", list(PROMPT), params)
    for w in (target, worker):
        asyncio.run(w.admit(state.request_id))
    steps, base, ready, hits, misses = [], 0, None, 0, 0
    while not state.finished:
        [want], _ = draft_budgets([state], K)
        if ready is not None:
            answer = ready
        else:
            answer = worker._run_batch([ProposeCall("r", base, state.context[base:], want + 1, params,
                                                    state.step, 64)])[0]
            base = state.length
        draft = answer.head(want)
        branches = rank_branches(answer.tokens, answer.top_ids, answer.top_probs, want, BRANCHES)
        tails = [b.tail(draft.tokens) for b in branches]
        pre_base = state.length
        drafts = worker._run_batch([PrespecCall("r", base, state.context[base:], tails, [K + 1] * len(tails),
                                                params, state.step + 1, 64)])[0]
        base = pre_base
        assert worker._ctx["r"] == state.context  # the mirror holds committed tokens only
        call = VerifyCall("r", state.length - 1, state.last_token, draft, params, state.step,
                          prefix=None if steps else state.context[:-1])
        steps.append(commit(state, target._run_batch([call])[0])[0])
        hit = match_branch(tails, state.context, pre_base)
        hits, misses = hits + (hit >= 0), misses + (hit < 0)
        ready = drafts[hit] if hit >= 0 else None
    assert steps == want_steps
    assert state.output_ids == result.token_ids
    if drafter == "draft":
        assert misses > 0
    elif sampling["temperature"] == 0.0:
        assert misses == 0 and hits == len(steps)


def test_a_late_or_stale_prespeculation_changes_nothing(tiny_models):
    """A pre-speculation call that runs after the next step's fresh draft (its cancellation came too late) leaves the
    worker's mirror of the context and the drafts that follow as they were; one of a coordinator that lost the
    request (an older epoch) is refused."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import PrespecCall, ProposeCall
    from deployments.workers import STALE
    from pipeline.config import SamplingParams

    params = SamplingParams(temperature=0.9, seed=11, max_tokens=64, ignore_eos=True)
    worker = DrafterWorker(str(tiny_models["draft"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN, prespec_branches=2)
    clean = DrafterWorker(str(tiny_models["draft"]), max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    for w in (worker, clean):
        asyncio.run(w.admit("r"))

    def propose(w, base, new, step, epoch=2):
        return w._run_batch([ProposeCall("r", base, new, K, params, step, 64, epoch=epoch)])[0]

    first = propose(worker, 0, PROMPT, 0)
    ctx1 = PROMPT + [5]  # the step's outcome: no draft accepted, recovered token 5 (no branch guessed it)
    fresh = propose(worker, len(PROMPT), [5], 1)
    late = PrespecCall("r", len(PROMPT), [], [[*first.tokens, 9], [1]], [K, K], params, 1, 64, epoch=2)
    drafts = worker._run_batch([late])[0]
    assert len(drafts) == 2 and all(d is not None for d in drafts)
    assert worker._ctx["r"] == ctx1  # not shortened to the context the call was made for
    assert propose(worker, len(ctx1), [], 1).tokens == fresh.tokens == propose(clean, 0, ctx1, 1, 1).tokens
    assert worker._run_batch([PrespecCall("r", len(ctx1), [], [[3]], [K], params, 2, 64, epoch=1)])[0] == STALE
    assert worker._ctx["r"] == ctx1
    asyncio.run(worker.release(["r"], 2))
    assert not any(worker.drafter.cached(k) for k in ("r", "r\x1f1", "r\x1f2"))  # every branch slot freed


@pytest.fixture(scope="module")
def server(tiny_models):
    from ray import serve

    from deployments.app import build_app

    config = {
        "served_model_name": MODEL,
        "target": {"model": str(tiny_models["llama"]), "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 2},
        "drafter": {"draft": str(tiny_models["llama"]), "max_batch_size": 2},  # the target drafting for itself
        "coordinator": {"adaptive_k": False, "prespec_branches": BRANCHES},
        "speculation": {"num_draft_tokens": K},
    }
    url = run_app(build_app(config), APP)
    yield url
    serve.delete(APP)


def complete(server: str, body: dict) -> tuple[list[int], dict]:
    ids, final = stream_completion(server, {"model": MODEL, "prompt": PROMPT, "stream": True, "ignore_eos": True,
                                            **body})
    return ids, final["speculation"]


@pytest.mark.slow
def test_every_step_of_a_sure_drafter_hits_and_is_counted(server, tiny_models):
    """The target drafting for itself, greedy: every draft token is accepted and the bonus token is the drafter's
    own top guess, so every step verified while the next was pre-speculated is a hit at accepted length K."""
    ids, spec = complete(server, {"max_tokens": 24, "temperature": 0})
    assert ids == engine_run(engine_for(tiny_models, "draft"), {"temperature": 0.0}, 24)[1].token_ids
    passes = spec["target_passes"]
    assert passes == 24 // (K + 1)
    assert spec["prespec_by_accepted"] == {str(K): [passes - 1, passes - 1]}  # the last step's outcome ends it
    assert spec["overlap_hits"] == passes - 1 and spec["overlap_tries"] >= passes - 1


@pytest.mark.slow
def test_seeded_requests_replay_and_match_the_engine(server, tiny_models):
    body = {"max_tokens": 40, **SAMPLING[1]}
    first, spec = complete(server, body)
    again, spec_again = complete(server, body)
    assert first == again
    assert first == engine_run(engine_for(tiny_models, "llama"), SAMPLING[1])[1].token_ids
    by_accepted = spec["prespec_by_accepted"]
    assert by_accepted == spec_again["prespec_by_accepted"]
    assert sum(n for n, _ in by_accepted.values()) <= spec["target_passes"]
    assert all(0 <= hit <= n for n, hit in by_accepted.values())
    assert sum(hit for _, hit in by_accepted.values()) == spec["overlap_hits"]
