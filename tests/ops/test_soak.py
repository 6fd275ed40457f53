"""`python -m ops.soak`, reduced to seconds: `specserve serve` with its metrics port, a 16-stream load (one round:
16 streamed requests of 8 tokens, all at once), then the TTL. One server start checks the metrics port (printed at
start, specserve's metrics and every metric the Grafana dashboard reads) and that the soak's own checks hold: no slot
in use and no Redis key left once the load has stopped and request_ttl_s (its minimum, 10 s) has passed. The long
soak (30 minutes, the curve of every process's RSS) is the command in docs/benchmarks.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT
from tests.support.cluster_harness import EVENT_ONLY_METRICS, PRESPEC_METRICS, dashboard_metric_names

pytestmark = pytest.mark.slow


def test_short_soak_metrics_port_and_ttl(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.soak", "--duration-s", "1", "--interval-s", "2", "--ttl-s", "10",
         "--settle-s", "3", "--max-tokens", "8", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = (out / "serve.log").read_text() if (out / "serve.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    # The soak stops `specserve serve` with Ctrl-C (SIGINT to the driver alone): a clean stop, without a traceback or
    # Serve's "graceful_shutdown failed ... infinite retries" line.
    assert result["serve_exit"] == 0 and "specserve: stopped." in log, log[-3000:]
    assert "graceful_shutdown" not in log and "Traceback" not in log, log
    assert result["ok"] and result["keys_left"] == 0 and result["slots_left"] == 0, result
    assert result["max_slots"] >= 1, result  # the load held slots, and the scrape saw them
    assert result["load"]["ok"] >= 16 and result["load"]["failed"] == 0, result

    # `specserve serve` printed where its metrics are: the port asked for, on the Ray node's IP. Ray's metrics
    # agent listens on loopback only when that IP is 127.0.0.1, else on every interface.
    port = re.search(r":(\d+)/metrics", result["metrics_url"]).group(1)
    printed = re.search(rf"metrics \(Prometheus\): http://([0-9.]+):{port}/metrics", log)
    assert printed, log
    assert result["metrics_listen"] == (["127.0.0.1"] if printed.group(1) == "127.0.0.1" else ["0.0.0.0"])

    text = (out / "metrics.txt").read_text()
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples.get("ray_specserve_generated_tokens_total", 0) > 0
    assert samples.get("ray_specserve_draft_tokens_total", 0) > 0
    exported = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in samples} | set(samples)
    # (the default drafter drafts in the target worker: no pre-speculation; tests/ops/test_ray_up.py's app has it)
    missing = {m for m in dashboard_metric_names() - EVENT_ONLY_METRICS - PRESPEC_METRICS if m not in exported}
    assert not missing, f"dashboard metrics not exported by specserve serve: {missing}"
