"""Admission end to end on CPU: real Ray Serve, real Redis (embedded), real HTTP clients (openai, httpx), a target
replica with 2 KV-cache slots and a queue of 3 (the app of tests/support/small_app.py, shared with the one-step
test). More concurrent requests than slots all complete with the target's greedy tokens and no replay; a request
beyond the queue gets 429 with Retry-After; requests whose clients leave give their slots and places back."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.support.serve import sse_events, tiny_engine, wait_for
from tests.support.small_app import APP, MODEL, QUEUE, RETRY_AFTER_S, SLOTS, K, small_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_models):
    return small_app(tiny_models)


def _target_stats():
    import ray

    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"{APP}:Target:"))
    return ray.get(ray.get_actor(name, namespace="specserve-workers").stats.remote())


def test_a_request_beyond_the_queue_gets_429_and_leaving_clients_free_their_slots(server):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stop = threading.Event()
    statuses: list[int] = []

    def hold(i: int) -> None:  # streams until told to go: its client then disconnects
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "prompt": [5 + i, 6, 7, 8]},
                          timeout=120) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(SLOTS + QUEUE)]
    try:
        threads[0].start()
        threads[1].start()
        wait_for(lambda: _target_stats()["slots_used"] == SLOTS, timeout_s=60)
        for t in threads[2:]:
            t.start()
        wait_for(lambda: _target_stats()["waiting"] == QUEUE, timeout_s=60)

        r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert r.status_code == 429
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        err = r.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and "retry" in err["message"]
        r = httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 429 and r.headers["retry-after"] == str(RETRY_AFTER_S)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    # Streams that ended early (their clients left) and those that never started gave everything back.
    stats = wait_for(lambda: (s := _target_stats())["slots_used"] == 0 and s["waiting"] == 0 and s, timeout_s=60)
    assert stats["preempted"] == 0
    assert statuses[:SLOTS] == [200, 200]
    # and the server still serves
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "max_tokens": 8}, timeout=60) as r:
        assert r.status_code == 200
        events = [d for _, d in sse_events(r.iter_lines())]
    assert events[-1] == "[DONE]" and not any(isinstance(d, dict) and "error" in d for d in events)


def test_more_requests_than_slots_all_complete_without_a_replay(server, tiny_models):
    import openai

    from pipeline.config import SamplingParams, SpecParams

    n = SLOTS + QUEUE  # every slot held and the queue full, never over it
    prompts = [[3 + i, 9 + 2 * i, 17 + i, 30 + 4 * i] for i in range(n)]
    want = [r.token_ids for r in tiny_engine(tiny_models, max_batch_size=n, max_seq_len=512).generate_batch(
        prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * n, SpecParams(K))]

    async def one(aclient, prompt):
        ids, spec = [], None
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].token_ids
            elif getattr(chunk, "speculation", None) is not None:
                spec = chunk.speculation
        return ids, spec

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*[one(ac, p) for p in prompts])

    got = asyncio.run(run_all())
    assert [ids for ids, _ in got] == want
    specs = [spec for _, spec in got]
    assert all(s["target_replays"] == 0 and s["preemptions"] == 0 for s in specs), specs
    assert sum(s["queue_wait_s"] > 0 for s in specs) >= 1, "no request waited for a slot"
    # Finished requests gave their slots back at once (well within the idle reclaim of a silent holder).
    stats = wait_for(lambda: (s := _target_stats())["slots_used"] == 0 and s["waiting"] == 0 and s, timeout_s=10)
    assert stats["preempted"] == 0
