"""`specserve chaos` reduced for CI: tiny models, 6 streams of 24 tokens, two faults (the target's worker process
and an external redis-server with AOF, both SIGKILLed mid-load and restarted). Every request completes, with exactly
the tokens and text of the fault-free run, none lost or duplicated. The full campaign (every fault, 16 streams, the
demo models) is `specserve chaos`; its table is in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from specserve.chaos import ChaosConfig, markdown_table, run_campaign
from tests.support.serve import ensure_serve

pytestmark = pytest.mark.slow


def test_target_and_redis_faults_lose_nothing(tiny_models, tmp_path):
    port = int(ensure_serve().rsplit(":", 1)[1])
    config = ChaosConfig(target=str(tiny_models["llama"]), draft=str(tiny_models["draft"]),
                         faults=("target", "redis-aof"), concurrency=6, num_requests=6, max_tokens=24,
                         max_seq_len=256, health_timeout_s=90)
    rows = run_campaign(config, tmp_path, http_port=port)
    print(markdown_table(rows))
    assert [r["fault"] for r in rows] == ["none (base)", "target", "none (aof)", "redis-aof"]
    for row in rows:
        assert row["completed"] == row["requests"] == 6, row
        assert row["mismatches"] == row["lost_tokens"] == row["duplicated_tokens"] == 0, row
        assert row["missing_events"] == row["duplicate_events"] == 0, row
        assert row["ok"], row
    assert rows[1]["recovery_s"] is not None and rows[1]["health_s"] is not None
    assert (tmp_path / "chaos.json").exists() and "| target |" in (tmp_path / "chaos.md").read_text()
