"""Feature heads (EAGLE-3, Medusa; random weights in the published layouts) in the Serve pipeline, in both placements
(`drafter.head_placement`): inside the target worker, and on a drafter replica fed with the target's states.

The first tests drive the worker classes by hand (no Ray), the coordinator's loop in miniature, against the
in-process engine: with the head in the target every step is the engine's (greedy and seeded); with the head on a
drafter replica the first step has no draft (the head has read nothing yet) and the output is the target's greedy
output, a seeded request replays; a target worker that restarts mid-request re-prefills and its head reads the
committed tokens again; multi-step calls (the worker feeding itself several passes) emit the engine's steps, behind
prompt lookup too. The last ones run one app per placement (real Ray, real Redis, HTTP; in the target the head runs
behind prompt lookup, as the demo target's default does): greedy output equals the engine's token for token, seeded
requests replay (and, head in the target, equal the engine's), and a request resumed from Redis (Last-Event-ID after
the client left) ends with the engine's tokens; an app whose head in the target drafts token trees (`drafter.tree`)
gives the engine's tokens with the same tree.

Sampled outputs follow the target's distribution because the steps are the engine's (`pipeline.step`, the same
verification and acceptance code); the distribution test with its negative control runs on the engine
(tests/pipeline/heads/test_heads.py).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.support.heads import make_eagle3_checkpoint, make_medusa_checkpoint
from tests.support.models import make_tiny_llama
from tests.support.serve import run_app, sse_events, stream_completion

V = 128
K = 3
MAX_SEQ_LEN = 256
PROMPT = [1, 5, 9, 17, 33, 65, 7, 7, 8]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_heads")
    target = make_tiny_llama(root / "target", vocab_size=V, hidden=32, layers=6, heads=4, kv_heads=2,
                             max_position_embeddings=512, seed=11)
    cfg = json.loads((target / "config.json").read_text())
    eagle3 = f"eagle3:{make_eagle3_checkpoint(root / 'eagle3', cfg, draft_vocab=96, seed=3)}"
    return {
        "target": str(target),
        "eagle3": eagle3,
        "lookup+eagle3": f"lookup+{eagle3}",  # prompt lookup first, the head elsewhere: both in the target worker
        "medusa": f"medusa:{make_medusa_checkpoint(root / 'medusa', 32, V, heads=3, layers=1, seed=1)}",
    }


def engine_steps(heads, word: str, sampling: dict, max_tokens: int = 40, tree=None) -> tuple[list[list[int]], object]:
    """The in-process engine's steps (token ids committed per target pass) and its result (`tree`: drafting token
    trees of that `TreeConfig`)."""
    from pipeline.config import EngineConfig, SamplingParams, SpecParams
    from pipeline.drafters import build_drafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model

    model, tok = load_model(heads["target"])
    drafter = build_drafter(word, model.info, tok, target=model)
    engine = SpeculativeEngine(model, tok, drafter, EngineConfig(max_batch_size=2, max_seq_len=MAX_SEQ_LEN, tree=tree))
    events = list(engine.stream(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                                SpecParams(K)))
    return [e.token_ids for e in events], events[-1].result


def run_target_placement(heads, word: str, params, restart_at: int = -1, tree=None) -> tuple[list[list[int]], object]:
    """The coordinator's loop with the head in the target worker: each verify call asks for the step's draft.
    restart_at: before that step, the worker is replaced by a fresh one (a restarted replica) and the call carries
    the committed tokens, as after a CACHE_MISS."""
    from deployments.messages import VerifyCall
    from deployments.target_replica import TargetWorker
    from deployments.workers import CACHE_MISS
    from pipeline.sequence import RequestState
    from pipeline.step import Draft, commit, draft_budgets

    def worker():
        w = TargetWorker(heads["target"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, head=word, tree=tree)
        asyncio.run(w.admit("r"))
        return w

    target = worker()
    state = RequestState("r", list(PROMPT), params)
    steps: list[list[int]] = []
    while not state.finished:
        if len(steps) == restart_at:
            target = worker()
        [want], _ = draft_budgets([state], K)
        call = VerifyCall("r", state.length - 1, state.last_token, Draft([]), params, state.step,
                          head_draft=want, draft_top_k=64)
        verdict = target._run_batch([call])[0]
        if verdict == CACHE_MISS:
            call.prefix = state.context[:-1]
            verdict = target._run_batch([call])[0]
        assert verdict.features is None  # the states stay in the target worker
        steps.append(commit(state, verdict)[0])
    return steps, state


def run_drafter_placement(heads, word: str, params) -> tuple[list[list[int]], object, list[int]]:
    """The coordinator's loop with the head on a drafter worker: each verdict brings the states the next propose call
    takes along. -> steps, state, bytes of states per step."""
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import HeadFeatures, ProposeCall, VerifyCall
    from deployments.target_replica import TargetWorker
    from deployments.workers import CACHE_MISS
    from pipeline.sequence import RequestState
    from pipeline.step import Draft, commit, draft_budgets

    target = TargetWorker(heads["target"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, head=word, head_in_target=False)
    drafter = DrafterWorker(word, max_batch_size=2, max_seq_len=MAX_SEQ_LEN, target=heads["target"])
    for w in (target, drafter):
        asyncio.run(w.admit("r"))
    state = RequestState("r", list(PROMPT), params)
    steps, sizes, pending, base = [], [], None, 0
    while not state.finished:
        [want], _ = draft_budgets([state], K)
        draft = Draft([])
        if pending is not None and want > 0:
            got = drafter._run_batch([ProposeCall("r", base, state.context[base:], want, params, state.step, 64,
                                                  features=pending)])[0]
            assert got != CACHE_MISS
            draft, pending, base = got.head(want), None, state.length
        call = VerifyCall("r", state.length - 1, state.last_token, draft, params, state.step,
                          prefix=None if steps else state.context[:-1])
        verdict = target._run_batch([call])[0]
        assert isinstance(verdict.features, HeadFeatures)
        assert verdict.features.start == (0 if not steps else state.length - 1)
        if steps:
            sizes.append(verdict.features.states.nbytes)
        pending = verdict.features if pending is None else pending.then(verdict.features)
        steps.append(commit(state, verdict)[0])
    return steps, state, sizes


@pytest.mark.parametrize("word", ["eagle3", "medusa"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_head_in_the_target_runs_the_engines_steps(heads, word, sampling):
    from pipeline.config import SamplingParams

    want_steps, result = engine_steps(heads, heads[word], sampling)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"seed": result.seed, **sampling})
    steps, state = run_target_placement(heads, heads[word], params)
    assert steps == want_steps
    assert state.stats.drafted == result.stats["drafted"] > 0
    assert state.stats.accepted == result.stats["accepted"]


@pytest.mark.parametrize("word,tree,sampling", [
    ("eagle3", "3,2,1", GREEDY), ("eagle3", "3,2,1", SEEDED), ("eagle3", "dyn:3,3,3:7", GREEDY),
    ("medusa", "3,2,1", SEEDED)])
def test_head_in_the_target_drafts_the_engines_trees(heads, word, tree, sampling):
    """`drafter.tree`: the head in the target worker drafts token trees and the worker's pass verifies them; every
    step is the engine's with the same tree (static, sampled, EAGLE-2's dynamic)."""
    from pipeline.config import SamplingParams, TreeConfig

    tree = {"3,2,1": TreeConfig((3, 2, 1)), "dyn:3,3,3:7": TreeConfig((3, 3, 3), 7, dynamic=True)}[tree]
    want_steps, result = engine_steps(heads, heads[word], sampling, tree=tree)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"seed": result.seed, **sampling})
    steps, state = run_target_placement(heads, heads[word], params, tree=tree)
    assert steps == want_steps
    assert state.stats.drafted == result.stats["drafted"] > 0 and state.stats.accepted == result.stats["accepted"]
    from deployments.target_replica import TargetWorker

    worker = TargetWorker(heads["target"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, head=heads[word], tree=tree)
    assert worker.head.tree is not None and (worker.head.dynamic is not None) == tree.dynamic


def run_multi_step(heads, word: str, params, steps_per_call: int) -> tuple[list[list[int]], object]:
    """The coordinator's multi-step calls with the head in the target worker: a one-step call prefills, then each
    `verify_steps` call runs up to `steps_per_call` passes, the worker making each next call from the verdict."""
    from deployments.messages import VerifyCall
    from deployments.target_replica import TargetWorker
    from pipeline.sequence import RequestState
    from pipeline.step import Draft, Verdict, commit, draft_budgets

    async def play():
        target = TargetWorker(heads["target"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, head=word)
        await target.admit("r")
        state = RequestState("r", list(PROMPT), params)
        steps: list[list[int]] = []
        while not state.finished:
            [want], _ = draft_budgets([state], K)
            call = VerifyCall("r", state.length - 1, state.last_token, Draft([]), params, state.step, head_draft=want,
                              draft_top_k=64, steps=steps_per_call if steps else 1, head_k=K,
                              remaining=state.remaining, prefix=None if steps else state.context[:-1])
            async for verdict in target.verify_steps(call):
                assert isinstance(verdict, Verdict) and not state.finished
                steps.append(commit(state, verdict)[0])
        return steps, state, target

    return asyncio.run(play())


@pytest.mark.parametrize("word", ["eagle3", "medusa", "lookup+eagle3"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_multi_step_calls_run_the_engines_steps(heads, word, sampling):
    """A worker that feeds itself several passes a call emits, step for step, what the engine does (so does a
    request whose token budget ends inside a call: 80 tokens in calls of 6 passes). Behind prompt lookup, the lookup
    reads the worker's copy of the committed tokens and drafts some of the steps."""
    from pipeline.config import SamplingParams

    want_steps, result = engine_steps(heads, heads[word], sampling, max_tokens=80)
    params = SamplingParams(max_tokens=80, ignore_eos=True, **{"seed": result.seed, **sampling})
    steps, state, target = run_multi_step(heads, heads[word], params, steps_per_call=6)
    assert steps == want_steps
    assert state.stats.drafted == result.stats["drafted"] and state.stats.accepted == result.stats["accepted"]
    if word.startswith("lookup+") and sampling is GREEDY:  # (the sampled output repeats itself too little)
        assert target.drafter.lookup_rows > 0 and target.drafter.model_rows > 0


@pytest.mark.parametrize("word", ["eagle3", "medusa"])
def test_a_restarted_target_replica_rereads_the_committed_tokens(heads, word):
    from pipeline.config import SamplingParams

    want_steps, result = engine_steps(heads, heads[word], GREEDY)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0, seed=0)
    steps, state = run_target_placement(heads, heads[word], params, restart_at=5)
    assert state.output_ids == result.token_ids
    assert steps[:5] == want_steps[:5]
    if word == "eagle3":  # a seeded request replays across the restart too
        seeded = SamplingParams(max_tokens=40, ignore_eos=True, **SEEDED)
        assert run_target_placement(heads, heads[word], seeded, 5)[1].output_ids == \
            run_target_placement(heads, heads[word], seeded, 5)[1].output_ids


@pytest.mark.parametrize("word", ["eagle3", "medusa"])
def test_head_on_a_drafter_reads_the_states_the_verdicts_carry(heads, word):
    from pipeline.config import SamplingParams

    _, result = engine_steps(heads, heads[word], GREEDY)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True, seed=0)
    steps, state, sizes = run_drafter_placement(heads, heads[word], greedy)
    assert state.output_ids == result.token_ids
    assert len(steps[0]) == 1 and state.stats.drafted > 0  # the first step has no draft, the others do
    width = 32 * (3 if word == "eagle3" else 1) * 4  # float32 states of one position
    assert all(size % width == 0 and size // width <= K + 1 for size in sizes)
    seeded = SamplingParams(max_tokens=40, ignore_eos=True, **SEEDED)
    first = run_drafter_placement(heads, heads[word], seeded)[1]
    assert run_drafter_placement(heads, heads[word], seeded)[1].output_ids == first.output_ids
    assert first.stats.drafted > 0


def test_a_drafter_without_the_states_answers_cache_miss(heads):
    from deployments.drafter_replica import DrafterWorker
    from deployments.messages import ProposeCall
    from deployments.workers import CACHE_MISS
    from pipeline.config import SamplingParams

    drafter = DrafterWorker(heads["eagle3"], max_batch_size=2, max_seq_len=MAX_SEQ_LEN, target=heads["target"])
    asyncio.run(drafter.admit("r"))
    call = ProposeCall("r", 0, PROMPT, K, SamplingParams(max_tokens=8, seed=0), 0, 64)
    assert drafter._run_batch([call])[0] == CACHE_MISS


# -- the whole app: real Ray, real Redis, HTTP ---------------------------------------------------------------


def complete(url: str, model: str, body: dict) -> tuple[list[int], dict]:
    ids, final = stream_completion(url, {"model": model, "prompt": PROMPT, "stream": True, "ignore_eos": True, **body})
    return ids, final["speculation"]


# The app with the head in the target runs it behind prompt lookup, as `specserve serve` deploys the demo target's.
IN_TARGET = "lookup+eagle3"


# The app whose head in the target drafts EAGLE-2 dynamic trees (`drafter.tree`)
TREE = {"branching": [3, 3, 3], "max_nodes": 7, "dynamic": True}


def deploy(heads, placement: str, tree: dict | None = None):
    from deployments.app import build_app

    name = f"{placement}-tree" if tree else placement
    drafter = {"draft": heads[IN_TARGET if placement == "target" else "eagle3"], "head_placement": placement,
               "max_batch_size": 2}
    if tree:
        drafter.update(draft=heads["eagle3"], tree=tree)
    config = {
        "served_model_name": f"tiny-head-{name}",
        "target": {"model": heads["target"], "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 2},
        "drafter": drafter,
        # chains: a fixed K, as the engine runs them here; trees turn the coordinator's default adaptive K off
        "coordinator": {} if tree else {"adaptive_k": False},
        "speculation": {"num_draft_tokens": K},
    }
    return run_app(build_app(config), f"heads-{name}"), config["served_model_name"]


@pytest.fixture(scope="module")
def head_in_target(heads):
    from ray import serve

    yield deploy(heads, "target")
    serve.delete("heads-target")


@pytest.fixture(scope="module")
def trees_in_target(heads):
    from ray import serve

    yield deploy(heads, "target", TREE)
    serve.delete("heads-target-tree")


@pytest.fixture(scope="module")
def head_on_drafter(heads):
    from ray import serve

    yield deploy(heads, "drafter")
    serve.delete("heads-drafter")


@pytest.mark.slow
def test_served_head_in_the_target_equals_the_engine(heads, head_in_target):
    url, model = head_in_target
    want_greedy = engine_steps(heads, heads[IN_TARGET], GREEDY)[1]
    ids, spec = complete(url, model, {"max_tokens": 40, **GREEDY})
    assert ids == want_greedy.token_ids
    assert spec["drafted"] == want_greedy.stats["drafted"] > 0 and spec["accepted"] == want_greedy.stats["accepted"]
    assert spec["steps_without_draft"] == 0
    assert spec["multi_step_calls"] >= 1  # after the prefill the worker fed itself several passes a call
    first, _ = complete(url, model, {"max_tokens": 40, **SEEDED})
    again, _ = complete(url, model, {"max_tokens": 40, **SEEDED})
    assert first == again == engine_steps(heads, heads[IN_TARGET], SEEDED)[1].token_ids


@pytest.mark.slow
def test_served_trees_in_the_target_equal_the_engine(heads, trees_in_target):
    """HTTP with `drafter.tree`: greedy requests (dynamic trees) and seeded ones (the static shape) give the engine's
    tokens with the same tree."""
    from pipeline.config import TreeConfig

    url, model = trees_in_target
    tree = TreeConfig(tuple(TREE["branching"]), TREE["max_nodes"], dynamic=True)
    want = engine_steps(heads, heads["eagle3"], GREEDY, tree=tree)[1]
    ids, spec = complete(url, model, {"max_tokens": 40, **GREEDY})
    assert ids == want.token_ids and spec["drafted"] == want.stats["drafted"] > 0
    assert spec["adaptive_k"] is False  # a static shape: the coordinator's default K policy is off
    seeded, _ = complete(url, model, {"max_tokens": 40, **SEEDED})
    assert seeded == engine_steps(heads, heads["eagle3"], SEEDED, tree=tree)[1].token_ids


@pytest.mark.slow
def test_served_head_in_the_target_resumes_from_redis(heads, head_in_target):
    """A client that leaves after a few events and comes back with Last-Event-ID: the request resumes from its
    committed tokens in Redis (its target slot, and the head's with it, read them again) and the whole output is the
    engine's."""
    url, model = head_in_target
    # Long enough that the cancellation reaches the coordinator before the request could finish.
    want = engine_steps(heads, heads[IN_TARGET], GREEDY, max_tokens=240)[1].token_ids
    body = {"model": model, "prompt": PROMPT, "stream": True, "ignore_eos": True, "max_tokens": 240, **GREEDY}
    ids, last = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for n, (eid, data) in enumerate(sse_events(r.iter_lines())):
            if data != "[DONE]" and data["choices"]:
                ids += data["choices"][0]["token_ids"]
                last = eid
            if n == 2:
                break  # the connection closes: the request is cancelled, resumable
    rest, final = stream_completion(url, {}, headers={"Last-Event-ID": last})
    assert ids + rest == want
    # the resumed loop generated the end: its target call missed (a fresh slot) and re-prefilled target and head
    assert final["speculation"]["target_replays"] >= 1 and final["speculation"]["drafted"] > 0
    assert final["speculation"]["multi_step_calls"] >= 1


@pytest.mark.slow
def test_served_head_on_a_drafter_gives_the_targets_greedy_output_and_replays(heads, head_on_drafter):
    url, model = head_on_drafter
    ids, spec = complete(url, model, {"max_tokens": 40, **GREEDY})
    assert ids == engine_steps(heads, heads["eagle3"], GREEDY)[1].token_ids
    assert spec["drafted"] > 0 and spec["drafter_failovers"] == 0
    assert spec["steps_without_draft"] == 1  # the first: the head has read no states yet
    first, spec = complete(url, model, {"max_tokens": 40, **SEEDED})
    again, _ = complete(url, model, {"max_tokens": 40, **SEEDED})
    assert first == again and spec["drafted"] > 0


@pytest.mark.slow
def test_served_head_on_a_drafter_survives_its_drafter_replica_being_killed(heads, head_on_drafter):
    """The drafter replica holding the request's head dies mid-stream: the request goes on (steps without drafts while
    no drafter lives, then a head that reads the states again, which a re-prefill of the target resends) and its greedy
    output is the engine's."""
    import ray
    import redis

    from tests.support.serve import redis_url, replica_actor, wait_for

    url, model = head_on_drafter
    want = engine_steps(heads, heads["eagle3"], GREEDY, max_tokens=240)[1].token_ids
    store = redis.Redis.from_url(redis_url("heads-drafter"), decode_responses=True)
    body = {"model": model, "prompt": PROMPT, "stream": True, "ignore_eos": True, "max_tokens": 240, **GREEDY}
    ids, killed, final = [], {}, {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for n, (eid, data) in enumerate(sse_events(r.iter_lines())):
            if data == "[DONE]":
                break
            if data["choices"]:
                ids += data["choices"][0]["token_ids"]
            final = data.get("speculation") or final
            if n == 2:
                key = f"specserve:req:{{{eid.rsplit(':', 1)[0]}}}"
                worker = wait_for(lambda: store.hget(key, "drafter_worker"))
                killed["replica"] = worker.split(":")[2]
                ray.kill(replica_actor("heads-drafter", "Drafter", killed["replica"]), no_restart=True)
    assert killed, "the stream ended before the kill"
    assert ids == want
    assert final["drafter_failovers"] >= 1, final
