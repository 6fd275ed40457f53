"""`specserve chaos` reduced for CI: tiny models, 6 streams of 24 tokens, two faults (the target's worker process
and the embedded redis-server, both SIGKILLed mid-load; Serve replaces them). Every request completes, with exactly
the tokens and text of the fault-free run, none lost or duplicated. The full campaign (every fault, 16 streams, the
demo models) is `specserve chaos`; its table is in docs/benchmarks.md."""

from __future__ import annotations

import time

import pytest

from specserve.chaos import ChaosConfig, markdown_table, run_campaign
from tests.support.serve import ensure_serve

pytestmark = pytest.mark.slow


def test_target_and_redis_faults_lose_nothing(tiny_models, tmp_path):
    port = int(ensure_serve().rsplit(":", 1)[1])
    config = ChaosConfig(target=str(tiny_models["llama"]), draft=str(tiny_models["draft"]),
                         faults=("target", "redis"), concurrency=6, num_requests=6, max_tokens=24,
                         max_seq_len=256, drafter_replicas=1, health_timeout_s=90)
    t0 = time.monotonic()
    rows = run_campaign(config, tmp_path, http_port=port,
                        log=lambda line: print(f"{time.monotonic() - t0:6.1f} s  {line}", flush=True))
    print(markdown_table(rows))
    assert [r["fault"] for r in rows] == ["none (base)", "target", "redis"]
    for row in rows:
        assert row["completed"] == row["requests"] == 6, row
        assert row["mismatches"] == row["lost_tokens"] == row["duplicated_tokens"] == 0, row
        assert row["missing_events"] == row["duplicate_events"] == 0, row
        assert row["ok"], row
    assert rows[1]["recovery_s"] is not None and rows[1]["health_s"] is not None
    assert (tmp_path / "chaos.json").exists() and "| target |" in (tmp_path / "chaos.md").read_text()


def test_store_reconnects_to_a_restarted_redis_and_a_lost_request_is_not_a_take_over():
    """What the Redis faults need from `RequestStore`: after its server is killed and another starts (on a new port,
    empty), the next operation reconnects through the URL getter instead of failing, and a commit for a request the
    new server lacks raises StateLost (the coordinator goes on unpersisted), not NotOwner (which stops the stream)."""
    import asyncio
    import signal

    from deployments.embedded_redis import EmbeddedRedis
    from deployments.redis_state import NotOwner, RequestStore, StateLost

    state = {"request_id": "r", "prompt_ids": [5, 6], "params": {"seed": 1}, "eos_token_ids": [2],
             "output_ids": [], "step": 0, "finish_reason": None, "stats": {}, "emitted_chars": 0}
    servers = [EmbeddedRedis().start()]

    async def url() -> str:
        return servers[-1].url

    async def run():
        store = await RequestStore.connect(url, namespace="chaos-unit", wait_s=10, retry_s=0.05)
        await store.create("r", "A", state, kind="completion")
        assert await store.commit("r", "A", 0, 1, [7], 1, None, {}, {"i": 0}) == 1
        servers[0]._proc.send_signal(signal.SIGKILL)
        servers[0]._proc.wait()
        servers.append(EmbeddedRedis().start())  # the replacement: another port, nothing in it
        with pytest.raises(StateLost):
            await store.commit("r", "A", 1, 2, [8], 2, None, {}, {"i": 1})
        with pytest.raises(StateLost):
            await store.set_fields("r", "A", target_worker="t")
        await store.create("s", "A", state, kind="completion")  # new requests are stored again
        assert (await store.load("s")).kind == "completion"
        with pytest.raises(NotOwner):
            await store.set_fields("s", "B", target_worker="t")
        await store.close()

    try:
        asyncio.run(run())
    finally:
        for server in servers:
            server.stop()


def test_the_cli_default_names_every_fault_in_order():
    from specserve import chaos, cmd_chaos

    assert tuple(cmd_chaos.FAULTS.split(",")) == chaos.FAULTS
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        ChaosConfig(faults=("nope",))
