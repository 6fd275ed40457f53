"""Tensor-parallel target replicas through the whole Serve pipeline on CPU (real Ray Serve, Redis, HTTP):
TP=2 over gloo gives the tokens of the single-process engine (TP=1), greedy and seeded sampled, batched;
a killed rank takes its replica down without a hang and the request resumes from Redis on the replacement
with exactly the tokens an undisturbed run gives; and the demo target at TP=2 (9 heads / 3 KV heads split
2 + 1 groups) is greedy-identical to TP=1."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.serve import redis_url, run_app, sse_events, tiny_engine, wait_for

pytestmark = pytest.mark.slow

APP = "tp"
MODEL = "tiny-tp"
MAX_SEQ_LEN = 256
K = 3
TP = {"tensor_parallel_size": 2, "resources": {"num_cpus": 0.01}}  # bundles must claim something on CPU


@pytest.fixture(scope="module")
def server(tiny_models):
    from ray import serve

    from deployments.app import build_app

    config = {
        "served_model_name": MODEL,
        "target": {"model": str(tiny_models["llama"]), "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 8, **TP},
        "drafter": {"draft": str(tiny_models["draft"])},
        "speculation": {"num_draft_tokens": K},
        "coordinator": {"replica_wait_s": 90},
    }
    url = run_app(build_app(config), APP)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return tiny_engine(tiny_models, max_batch_size=8, max_seq_len=MAX_SEQ_LEN)


def reference(engine, prompt, **params):
    from pipeline.config import SamplingParams, SpecParams

    return engine.generate(prompt, SamplingParams(ignore_eos=True, **params), SpecParams(K)).token_ids


def rank_actors(app: str) -> dict[str, list]:
    """replica id -> [rank 0 name, rank 1 name, ...] of the app's target workers."""
    import ray

    out: dict[str, list] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "specserve-workers" and a["name"].startswith(f"{app}:Target:"):
            _, _, replica, rank = a["name"].split(":")
            out.setdefault(replica, []).append((int(rank), a["name"]))
    return {r: [n for _, n in sorted(v)] for r, v in out.items()}


def test_replica_has_two_ranks_in_one_packed_placement_group(server):
    import ray

    replicas = rank_actors(APP)
    assert len(replicas) == 1 and len(next(iter(replicas.values()))) == 2
    names = next(iter(replicas.values()))
    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"
           and pg["strategy"] == "STRICT_PACK" and list(pg["bundles"].values()) == [{"CPU": 0.01}] * 2]
    assert len(pgs) == 1, ray.util.placement_group_table()  # the bundles deployment_options computed
    assert ray.get(ray.get_actor(names[1], namespace="specserve-workers").ping.remote())


def test_greedy_and_seeded_sampled_tokens_equal_the_tp1_engine(server, engine):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = [1, 17, 42, 99, 5, 61]
    want = reference(engine, prompt, temperature=0.0, max_tokens=40)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].token_ids == want
    assert got.speculation["drafted"] > 0
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40)
    want = reference(engine, prompt, **kw)
    got = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **kw)
    assert got.choices[0].token_ids == want


def test_concurrent_streams_are_batched_on_the_tp_replica(server, engine):
    import openai
    import ray

    prompts = [[1 + i, 7 + 3 * i, 11 + i, 40 + 5 * i] for i in range(6)]
    want = [reference(engine, p, temperature=0.0, max_tokens=24) for p in prompts]
    rank0 = ray.get_actor(next(iter(rank_actors(APP).values()))[0], namespace="specserve-workers")
    before = ray.get(rank0.stats.remote())

    async def one(ac, prompt):
        out = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        return out.choices[0].token_ids

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*[one(ac, p) for p in prompts])

    assert asyncio.run(run_all()) == want
    after = ray.get(rank0.stats.remote())
    rows, batches = after["rows"] - before["rows"], after["batches"] - before["batches"]
    assert rows / batches > 1.3, f"verify calls were not batched: {rows} rows in {batches} target passes"


def test_a_killed_rank_takes_the_replica_down_and_the_request_resumes_exactly(server, engine):
    import httpx
    import ray
    import redis

    prompt = [5, 4, 3, 2, 1]
    want = reference(engine, prompt, temperature=0.8, seed=77, max_tokens=160)
    r = redis.Redis.from_url(redis_url(APP), decode_responses=True)
    (old_replica, old_ranks), = rank_actors(APP).items()
    body = dict(model=MODEL, prompt=prompt, max_tokens=160, temperature=0.8, seed=77, stream=True, ignore_eos=True)
    ids, final, killed_at = [], None, None
    t0 = time.monotonic()
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200
        for n, (eid, data) in enumerate(sse_events(resp.iter_lines())):
            if data == "[DONE]":
                break
            assert "error" not in data, data
            if data["choices"]:
                ids += data["choices"][0]["token_ids"]
                if n == 2:  # kill rank 1 (a follower) mid-stream
                    ray.kill(ray.get_actor(old_ranks[1], namespace="specserve-workers"), no_restart=True)
                    killed_at, rid = time.monotonic(), eid.rsplit(":", 1)[0]
            else:
                final = data
    elapsed = time.monotonic() - t0
    assert killed_at is not None, "the stream ended before the kill"
    assert ids == want  # exactly the tokens of an undisturbed run
    assert final["usage"]["completion_tokens"] == 160
    assert final["speculation"]["target_failovers"] >= 1
    assert elapsed < 150, f"took {elapsed:.0f} s"
    target_worker = r.hgetall(f"specserve:req:{{{rid}}}")["target_worker"]
    assert old_replica not in target_worker  # finished on the replacement replica
    # The lost replica is gone entirely (rank 0 exited, the host replaced, its ranks with it).
    wait_for(lambda: old_replica not in rank_actors(APP) and len(rank_actors(APP)) == 1, timeout_s=60)
    print(f"kill -> completion {time.monotonic() - killed_at:.1f} s")


def test_demo_target_tp2_greedy_equals_tp1(server, demo_path):
    import openai
    import torch
    from ray import serve

    from deployments.app import build_app
    from pipeline.models.loader import load_model

    serve.delete(APP)  # one app at a time on 2 cores
    runner, tokenizer = load_model(demo_path)
    prompt = tokenizer("The three primary colors are").input_ids
    runner.allocate(1, 128)
    tokens = list(prompt)
    logits = runner.forward(torch.tensor([tokens]), torch.tensor([0]), torch.tensor([0]), len(tokens) - 1)
    for _ in range(24):
        tokens.append(int(logits[0, -1].argmax()))
        logits = runner.forward(torch.tensor([[tokens[-1]]]), torch.tensor([len(tokens) - 1]), torch.tensor([0]))
    want = tokens[len(prompt):]

    url = run_app(build_app({"target": {"model": demo_path, "max_seq_len": 512, "max_batch_size": 2, **TP}}), "tpdemo")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for spec in ({}, {"drafter": False}):  # prompt lookup (the default drafter), and target-only
            out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True, "speculation": spec})
            assert out.choices[0].token_ids == want, spec
        assert len(next(iter(rank_actors("tpdemo").values()))) == 2
    finally:
        serve.delete("tpdemo")
