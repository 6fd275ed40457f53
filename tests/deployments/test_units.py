"""Unit tests of the Serve layer's pure parts: config -> deployment options, protocol validation, SSE,
and the Redis request store against a real (embedded) Redis server. No Ray here."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from pydantic import ValidationError

from deployments import config as cfg
from deployments.embedded_redis import EmbeddedRedis
from deployments.protocol import APIError, parse_request, resolve_max_tokens
from deployments.redis_conn import RedisUnavailable, check_reachable
from deployments.redis_state import NotOwner, RequestStore
from deployments.sse import DONE, format_event, parse_event_id, sse_stream

# -- config -> options ------------------------------------------------------------------------------------

def test_cpu_defaults_need_no_placement_group_and_claim_no_cpu():
    opts = cfg.deployment_options(cfg.AppConfig(redis_url=None, drafter={"draft": "/m/d"}))
    assert set(opts) == {cfg.TARGET, cfg.DRAFTER, cfg.COORDINATOR, cfg.INGRESS, cfg.EMBEDDED_REDIS}
    for name, o in opts.items():
        assert o["name"] == name
        assert o["ray_actor_options"]["num_cpus"] == 0, name  # 2-core machines: nothing claims a CPU
        assert "placement_group_bundles" not in o, name
    # a dead embedded redis-server is replaced after 3 failed checks: seconds, as a model replica
    assert opts[cfg.EMBEDDED_REDIS]["health_check_period_s"] == opts[cfg.TARGET]["health_check_period_s"] == 2.0


def test_gpu_target_with_tensor_parallelism_gets_one_packed_bundle_per_rank():
    c = cfg.AppConfig(redis_url="redis://r:6379/0", target={
        "tensor_parallel_size": 4,
        "resources": {"num_replicas": 2, "num_gpus": 1, "num_cpus": 2, "accelerator_type": "H100"}})
    o = cfg.deployment_options(c)[cfg.TARGET]
    assert o["num_replicas"] == 2
    assert o["placement_group_strategy"] == "STRICT_PACK"
    assert o["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "accelerator_type:H100": 0.001}] * 4
    assert o["ray_actor_options"] == {"num_cpus": 0}  # the host fits in bundle 0 without claiming
    assert cfg.EMBEDDED_REDIS not in cfg.deployment_options(c)  # an external Redis is used


def test_cheap_gpu_drafter_bundle_and_worker_options():
    c = cfg.AppConfig(redis_url=None, drafter={"draft": "/m/d", "resources": {
        "num_replicas": 3, "num_gpus": 1, "accelerator_type": "T4", "memory_gb": 2}})
    o = cfg.deployment_options(c)[cfg.DRAFTER]
    assert o["num_replicas"] == 3
    assert o["placement_group_bundles"] == [{"GPU": 1, "accelerator_type:T4": 0.001, "memory": float(2 * 2**30)}]
    w = cfg.worker_actor_options(c.drafter.resources, has_placement_group=True)
    assert w["num_gpus"] == 1 and w["memory"] == 2 * 2**30 and "accelerator_type" not in w
    w = cfg.worker_actor_options(c.drafter.resources, has_placement_group=False)
    assert w["accelerator_type"] == "T4"


def test_prompt_lookup_and_no_drafter_have_no_drafter_deployment():
    for draft in ("prompt-lookup", "suffix", "none"):
        assert cfg.DRAFTER not in cfg.deployment_options(cfg.AppConfig(drafter={"draft": draft}))
    for draft in ("/m/d", "lookup+/m/d"):
        assert cfg.DRAFTER in cfg.deployment_options(cfg.AppConfig(drafter={"draft": draft}))


def test_drafter_config_speaks_the_cli_vocabulary():
    d = cfg.DrafterConfig(draft="lookup+/m/d")
    assert d.model == "/m/d" and d.uses_model and d.drafts
    assert d.with_model("/abs/d").draft == "lookup+/abs/d"
    assert cfg.DrafterConfig().draft == "prompt-lookup" and cfg.DrafterConfig().model is None
    assert not cfg.DrafterConfig(draft="none").drafts
    for old in ("prompt_lookup", "hybrid", "model"):
        with pytest.raises(ValidationError, match="drafter.draft=.*use the CLI's words"):
            cfg.DrafterConfig(draft=old)


def test_config_rejects_bad_values_clearly():
    with pytest.raises(ValidationError, match="needs num_gpus > 0"):
        cfg.Resources(accelerator_type="L4")
    with pytest.raises(ValidationError, match="redis_url must start with"):
        cfg.AppConfig(redis_url="localhost:6379")
    with pytest.raises(ValidationError):
        cfg.AppConfig(target={"tensor_parallel_size": 0})
    with pytest.raises(ValidationError):
        cfg.AppConfig(unknown_field=1)  # typos in a Serve config file are errors, not ignored
    with pytest.raises(ValueError, match="needs num_cpus > 0"):
        cfg.worker_bundles(cfg.Resources(), tensor_parallel_size=2)


def test_redis_url_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:1/2")
    assert cfg.AppConfig().redis_url == "redis://example:1/2"
    monkeypatch.delenv("REDIS_URL")
    assert cfg.AppConfig().redis_url is None


# -- protocol ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": -0.1}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "x", "n": 2}, "n"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": "x", "speculation": {"num_draft_tokens": 65}}, "speculation.num_draft_tokens"),
    ({"model": "m", "prompt": "x", "stop": ["", "a"]}, "stop"),
    ({"model": "m", "prompt": "x", "presence_penalty": 1.0}, "presence_penalty"),
])
def test_bad_completion_requests_are_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as e:  # request fields at parsing; sampling fields when the SamplingParams is made
        parse_request("completion", body).sampling_params(16)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_request_needs_messages_and_maps_max_completion_tokens():
    with pytest.raises(APIError):
        parse_request("chat", {"model": "m", "messages": []})
    with pytest.raises(APIError):
        parse_request("chat", [1, 2])
    req = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                 "max_completion_tokens": 7, "temperature": 0})
    assert req.effective_max_tokens() == 7
    sp = req.sampling_params(7)
    assert sp.greedy and sp.seed is not None  # a seed is always fixed, so the run can be replayed


def test_spec_params_extension():
    req = parse_request("completion", {"model": "m", "prompt": "x", "speculation": {"num_draft_tokens": 6}})
    assert req.spec_params(4, 64, has_drafter=True).num_draft_tokens == 6
    assert req.spec_params(4, 64, has_drafter=False).num_draft_tokens == 0
    req = parse_request("completion", {"model": "m", "prompt": "x", "speculation": {"drafter": False}})
    assert req.spec_params(4, 64, has_drafter=True).num_draft_tokens == 0


def test_context_checks():
    assert resolve_max_tokens(None, 10, 64) == 54
    assert resolve_max_tokens(54, 10, 64) == 54
    with pytest.raises(APIError) as e:
        resolve_max_tokens(55, 10, 64)
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        resolve_max_tokens(1, 64, 64)
    assert e.value.param == "prompt"


# -- SSE --------------------------------------------------------------------------------------------------

def test_sse_format_and_event_ids():
    assert format_event({"a": 1}, "r:3") == 'id: r:3\ndata: {"a":1}\n\n'
    assert parse_event_id("cmpl-x:12") == ("cmpl-x", 12)
    assert parse_event_id("cmpl-x") == ("cmpl-x", -1)
    with pytest.raises(APIError):
        parse_event_id("cmpl-x:abc")


def test_sse_stream_ends_with_done_even_after_an_error():
    async def events():
        yield "r:0", {"x": 1}
        raise APIError("boom", 400)

    async def collect():
        return [c async for c in sse_stream(events())]

    chunks = asyncio.run(collect())
    assert chunks[0].startswith("id: r:0\n")
    assert json.loads(chunks[1][len("data: "):])["error"]["message"] == "boom"
    assert chunks[-1] == DONE


# -- Redis ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


def test_unreachable_redis_is_a_clear_error():
    with pytest.raises(RedisUnavailable, match="redis://127.0.0.1:1/0 is unreachable"):
        check_reachable("redis://127.0.0.1:1/0", timeout_s=0.5)


def _state(rid):
    return {"request_id": rid, "prompt_ids": [5, 6, 7], "params": {"temperature": 0.5, "seed": 9, "stop": []},
            "eos_token_ids": [2], "output_ids": [], "step": 0, "finish_reason": None,
            "stats": {"drafted": 0}, "emitted_chars": 0}


def test_request_store_commit_fencing_take_over_and_ttl(redis_server):
    async def run():
        store = RequestStore.from_url(redis_server.url, namespace=f"t{uuid.uuid4().hex[:6]}", ttl_s=60)
        rid = "cmpl-1"
        await store.create(rid, "A", _state(rid), kind="completion", model="m")
        with pytest.raises(ValueError):
            await store.create(rid, "A", _state(rid), kind="completion", model="m")
        assert await store.commit(rid, "A", 0, 1, [10, 11], 3, None, {"drafted": 2}, {"i": 0, "text": "abc"}) == 2
        with pytest.raises(NotOwner):  # a stale step counter is refused
            await store.commit(rid, "A", 0, 1, [12], 4, None, {}, None)
        # B takes over: A is fenced out from now on, whatever it still tries.
        got = await store.take_over(rid, "B")
        assert got.output_ids == [10, 11] and got.step == 1 and got.kind == "completion"
        with pytest.raises(NotOwner):
            await store.commit(rid, "A", 1, 2, [12], 4, None, {}, None)
        await store.commit(rid, "B", 1, 2, [12], 4, "stop", {"drafted": 3}, {"i": 1, "text": "d"})
        got = await store.load(rid)
        assert got.finished and got.state_dict()["output_ids"] == [10, 11, 12]
        assert got.state_dict()["finish_reason"] == "stop" and got.json("stats") == {"drafted": 3}
        assert [e["i"] for e in await store.events(rid, 1)] == [1]
        assert 0 < await store.ttl(rid) <= 60
        for key in store.keys(rid):
            assert 0 < await store.client.ttl(key) <= 60, key
        assert await store.take_over("nope", "B") is None
        await store.close()

    asyncio.run(run())


def test_store_connect_waits_for_a_restarted_server_on_its_new_url(redis_server):
    """An embedded server being replaced comes back on a new port: connect keeps asking for the URL and pinging
    until one answers, and gives up with a clear error after `wait_s`."""
    from deployments.embedded_redis import _free_port

    dead = f"redis://127.0.0.1:{_free_port('127.0.0.1')}/0"  # nothing listens there
    asked = []

    async def url() -> str:  # the first two answers are the server that died
        asked.append(1)
        return dead if len(asked) <= 2 else redis_server.url

    async def run():
        store = await RequestStore.connect(url, namespace=f"t{uuid.uuid4().hex[:6]}", wait_s=30, retry_s=0.05)
        assert await store.client.ping()
        await store.close()
        with pytest.raises(RuntimeError, match="is unreachable"):
            await RequestStore.connect(lambda: asyncio.sleep(0, dead), wait_s=0.2, retry_s=0.05)

    asyncio.run(run())
    assert len(asked) == 3


def test_state_dict_round_trips_into_the_pipeline_request_state(redis_server):
    from pipeline.config import SamplingParams
    from pipeline.sequence import RequestState

    async def run():
        store = RequestStore.from_url(redis_server.url, namespace=f"t{uuid.uuid4().hex[:6]}")
        st = RequestState("cmpl-2", [1, 2, 3], SamplingParams(temperature=0.7, seed=5, stop=("x",)), (2,))
        await store.create("cmpl-2", "A", st.to_dict(), kind="completion")
        st.commit([7, 8], 3, 1)
        await store.commit("cmpl-2", "A", 0, st.step, [7, 8], 0, None, st.to_dict()["stats"], None)
        back = RequestState.from_dict((await store.load("cmpl-2")).state_dict())
        assert back.output_ids == [7, 8] and back.step == 1 and back.params == st.params
        assert back.stats.drafted == 3 and back.stats.accepted == 1
        await store.close()

    asyncio.run(run())


# -- CLI and Serve config file ------------------------------------------------------------------------------

def _serve_args(*argv):
    import argparse

    from specserve import cmd_serve

    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_overrides_the_config_file():
    from specserve.cmd_serve import load_config

    c = load_config(_serve_args("--config", "ops/deploy/serve-demo.yaml", "--draft", "/m/d", "-k", "6",
                                "--coordinators", "2", "--target-threads", "2", "--no-overlap"))
    assert c.drafter.draft == "/m/d" and c.drafter.model == "/m/d"
    assert c.speculation.num_draft_tokens == 6 and c.coordinator.num_replicas == 2
    assert c.target.resources.torch_threads == 2 and c.coordinator.overlap is False
    assert c.target.max_seq_len == 2048  # from the file
    assert load_config(_serve_args("--draft", "none")).drafter.draft == "none"
    demo = load_config(_serve_args())  # the demo target: prompt lookup + its shipped EAGLE-3 head, in the target
    assert demo.drafter.draft == "lookup+eagle3:smollm2-135m-eagle3" and demo.drafter.head_in_target
    assert demo.drafter.model is None
    assert load_config(_serve_args("--target", "/m/other")).drafter.draft == "prompt-lookup"  # the target's default
    # a config file that names its drafter keeps it
    assert load_config(_serve_args("--config", "ops/deploy/serve-demo.yaml")).drafter.draft == "prompt-lookup"


def test_serve_config_file_is_valid_and_builds_the_app():
    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import app_builder

    raw = yaml.safe_load(open("ops/deploy/serve-demo.yaml"))
    schema = ServeDeploySchema.model_validate(raw)
    app_cfg = schema.applications[0]
    assert app_cfg.import_path == "deployments.app:app_builder"
    app = call_user_app_builder_with_args_if_necessary(app_builder, app_cfg.args)

    def names(node):  # the deployment graph: bound deployments reachable through init args
        from ray.serve.deployment import Application

        d = node._bound_deployment
        out = {d.name}
        for arg in d.init_args:
            if isinstance(arg, Application):
                out |= names(arg)
        return out

    assert names(app) == {"Ingress", "Coordinator", "Target", "EmbeddedRedis"}  # prompt lookup: no Drafter


def test_cli_fails_clearly_when_redis_is_unreachable():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specserve", "serve", "--redis-url", "redis://127.0.0.1:1/0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Redis at redis://127.0.0.1:1/0 is unreachable" in r.stderr
    assert "Traceback" not in r.stderr


def test_build_app_fails_clearly_when_redis_is_unreachable():
    from deployments.app import build_app

    with pytest.raises(RedisUnavailable, match="unreachable"):
        build_app({"redis_url": "redis://127.0.0.1:1/0"})


# -- step batching ------------------------------------------------------------------------------------------

def test_step_batcher_batches_concurrent_calls_and_bounds_prefills_per_pass():
    import threading
    from dataclasses import dataclass

    from deployments.batching import StepBatcher

    @dataclass
    class Row:
        name: str
        cost: int

    passes: list[list[str]] = []
    started, gate = threading.Event(), threading.Event()

    def run(rows):
        started.set()
        gate.wait(30)  # the first pass blocks until every call below is queued
        passes.append([r.name for r in rows])
        return [r.name.upper() for r in rows]

    async def scenario():
        b = StepBatcher(run, max_batch=8, wait_ms=0, token_budget=1000)
        first = asyncio.ensure_future(b.submit("a", Row("a", 5)))
        while not started.is_set():  # pass 1 = [a] is running; the rest queue up behind it
            await asyncio.sleep(0.01)
        calls = [b.submit("p1", Row("p1", 800)), b.submit("p2", Row("p2", 900)), b.submit("d1", Row("d1", 5)),
                 b.submit("a", Row("a2", 5)), b.submit("d2", Row("d2", 5))]
        tasks = [asyncio.ensure_future(c) for c in calls]
        cancelled = asyncio.ensure_future(b.submit("x", Row("x", 5)))
        for _ in range(5):  # every task reaches its place in the queue (event-loop turns, not wall time)
            await asyncio.sleep(0)
        cancelled.cancel()
        gate.set()
        return await first, await asyncio.gather(*tasks)

    first, results = asyncio.run(scenario())
    assert first == "A" and results == ["P1", "P2", "D1", "A2", "D2"]
    # pass 2: one prefill (p2 would exceed the budget) and every decode row; the cancelled call never runs.
    assert passes == [["a"], ["p1", "d1", "a2", "d2"], ["p2"]]


def test_target_worker_chunked_prefill_gives_the_same_verdicts(tiny_models):
    """A long prompt prefilled in PREFILL_CHUNK pieces over several passes, with another request decoding
    in between, verifies exactly as the engine's one-shot prefill does."""
    import torch

    from deployments import target_replica as tr
    from pipeline.config import SamplingParams
    from pipeline.models.loader import load_model
    from pipeline.step import Draft, Verdict

    worker = tr.TargetWorker(str(tiny_models["llama"]), max_batch_size=2, max_seq_len=600)
    prompt = [(7 * i + 3) % 128 for i in range(2 * tr.PREFILL_CHUNK + 50)]
    params = SamplingParams(seed=5)
    row = tr.VerifyCall("long", len(prompt) - 1, prompt[-1], Draft([5, 6]), params, 0, prefix=prompt[:-1])
    other = tr.VerifyCall("short", 2, 9, Draft([1]), params, 0, prefix=[4, 8])
    for rid in ("long", "short"):  # a pass serves requests that hold a slot (verify() admits them)
        assert asyncio.run(worker.admit(rid)) == 0.0
    results = []
    for _ in range(3):  # the batcher re-queues AGAIN rows; here by hand
        out = worker._run_batch([row, other] if not results else [row])
        results.append(out[0])
        if out[0] != tr.AGAIN:
            break
    assert results[:-1] == [tr.AGAIN, tr.AGAIN] and isinstance(results[-1], Verdict)

    ref, _ = load_model(str(tiny_models["llama"]))
    ref.allocate(1, 700)
    with torch.inference_mode():
        ref.forward(torch.tensor([prompt[:-1]]), torch.tensor([0]), torch.tensor([0]), len(prompt) - 2)
        logits = ref.forward(torch.tensor([[prompt[-1], 5, 6]]), torch.tensor([len(prompt) - 1]), torch.tensor([0]))
    # greedy: the accepted drafts are the argmax where they match it, then the argmax after them
    argmax = logits.argmax(-1)[0].tolist()
    n = 0 if argmax[0] != 5 else (1 if argmax[1] != 6 else 2)
    assert results[-1].num_accepted == n and results[-1].tokens == argmax[: n + 1]


def test_step_batcher_requeues_unfinished_rows_first():
    from deployments.batching import AGAIN, StepBatcher

    passes: list[list[str]] = []
    left = {"long": 2}

    def run(rows):
        import time

        passes.append(list(rows))
        time.sleep(0.05)  # "short" arrives while the first pass runs
        out = []
        for r in rows:
            if left.get(r, 0):
                left[r] -= 1
                out.append(AGAIN)
            else:
                out.append(r + "!")
        return out

    async def scenario():
        b = StepBatcher(run, max_batch=4)
        long = asyncio.ensure_future(b.submit("long", "long"))
        await asyncio.sleep(0.02)
        short = asyncio.ensure_future(b.submit("short", "short"))
        return await long, await short

    assert asyncio.run(scenario()) == ("long!", "short!")
    assert passes[0] == ["long"] and all(p[0] == "long" for p in passes[:3]) and len(passes) == 3
    assert "short" in passes[1]  # a running request steps while the long prompt is still prefilling


def test_step_batcher_runs_state_changes_between_passes_never_during_one():
    """A worker's release changes state its passes read: it must wait for the running pass (the race that lost
    two requests to a KeyError in the drafter under autoscaling load)."""
    import threading
    import time

    from deployments.batching import StepBatcher

    events: list[str] = []
    started = threading.Event()

    def run(rows):
        events.append("pass start")
        started.set()
        time.sleep(0.2)
        events.append("pass end")
        return rows

    async def scenario():
        b = StepBatcher(run, max_batch=4)
        step = asyncio.ensure_future(b.submit("r", "row"))
        while not started.is_set():
            await asyncio.sleep(0.005)
        await b.run_in_worker(lambda: events.append("release"))
        return await step

    assert asyncio.run(scenario()) == "row"
    assert events == ["pass start", "pass end", "release"]


def test_embedded_redis_outlives_its_starting_thread_and_dies_with_its_process():
    import subprocess
    import sys
    import threading
    import time

    from deployments.redis_conn import ping

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", EmbeddedRedis().start()))
    t.start()
    t.join()
    time.sleep(0.5)
    try:
        assert ping(box["r"].url)  # a Serve replica may construct it on a pool thread that exits
    finally:
        box["r"].stop()

    code = ("from deployments.embedded_redis import EmbeddedRedis; r = EmbeddedRedis().start(); "
            "print(r._proc.pid, flush=True); import time; time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(owner.stdout.readline())
    owner.kill()  # SIGKILL: no cleanup code runs in the owner
    owner.wait()

    def gone():
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] in ("Z", "X")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), "redis-server outlived its owner"


def test_pad_sparse_leaves_each_rows_distribution_unchanged():
    """Rows with shorter draft supports are padded to the widest; the dense distribution the verifier builds
    from the padded block equals each row's own."""
    import numpy as np
    import torch

    from pipeline.rejection import _dense_draft_probs
    from pipeline.step import Draft, pack

    rows = [
        Draft([5, 6], np.array([[5, 2, 9], [6, 7, 8]]),
              np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]], dtype=np.float32)),
        Draft([4, 4], np.array([[4], [4]]), np.array([[1.0], [1.0]], dtype=np.float32)),
        Draft([3, 2]),  # point masses
    ]
    block = pack(rows)
    assert block.token_ids.tolist() == [[5, 6], [4, 4], [3, 2]] and block.num_draft.tolist() == [2, 2, 2]
    dense = _dense_draft_probs(block, torch.ones(3, 2, dtype=torch.bool), 16)
    assert torch.allclose(dense[:, :2].sum(-1), torch.ones(3, 2))
    assert dense[0, 0, 5] == 0.5 and dense[0, 0, 2] == pytest.approx(0.3) and dense[1, 0, 4] == 1.0
    assert dense[2, 0, 3] == 1.0 and dense[2, 1, 2] == 1.0


def test_workers_warm_every_graph_bucket_before_serving(tiny_models):
    """`warm_up` asks a worker's model for every batch size up to the replica's slots and every token bucket (a
    verify block of any captured K, a drafter's catch-up); a model without graphs (CPU) captures nothing."""
    from deployments.workers import warm_up
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.loader import load_model

    class Recording:
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def warmup(self, max_batch: int, max_tokens: int | None) -> int:
            self.calls.append((max_batch, max_tokens))
            return 3

    model = Recording()
    assert warm_up(model, 16, "target") == 3 and model.calls == [(16, None)]  # None: every token bucket
    assert warm_up(object(), 16, "target") == 0  # an eager runner: nothing to warm
    graph = GraphCausalLM(load_model(tiny_models["llama"])[0], GraphConfig(graphs=False, compile=False))
    graph.allocate(4, 64)
    assert warm_up(graph, 4, "drafter") == 0  # no CUDA graphs on CPU
