"""`ray up` of ops/cluster-local.yaml for real (local provider over SSH on 127.0.0.1), `serve deploy` of
ops/serve-local.yaml onto it, a streamed request, then `ray down` leaving nothing running.

Needs openssh-server and rsync (ops/setup_ci_extras.sh installs them); see tests/ops_cluster_harness.py
for what the test sets up on the machine and removes afterwards.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import yaml

from ops_cluster_harness import ROOT, LocalCluster, cluster_processes, free_port, missing_tools, port_open

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path_factory):
    missing = missing_tools()
    if missing:
        message = f"ray up test needs {missing}: run ops/setup_ci_extras.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    if os.geteuid() != 0:
        pytest.skip("the local-provider launch logs in as root over SSH")
    c = LocalCluster(tmp_path_factory.mktemp("rayup"))
    try:
        c.setup()
        yield c
    finally:
        c.teardown()


def _serve_config(c: LocalCluster, tiny_models: dict, http_port: int) -> str:
    config = yaml.safe_load((ROOT / "ops" / "serve-local.yaml").read_text())
    config["http_options"]["port"] = http_port
    args = config["applications"][0]["args"]
    args["target"]["model"] = str(tiny_models["llama"])
    args["drafter"]["model"] = str(tiny_models["draft"])
    path = c.tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _wait_running(c: LocalCluster, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    status: dict = {}
    while time.time() < deadline:
        out = c.serve("status", "-a", c.dashboard, timeout=60)
        if out.returncode == 0:
            status = yaml.safe_load(out.stdout) or {}
            app = (status.get("applications") or {}).get("specserve") or {}
            if app.get("status") == "RUNNING":
                return app
            if app.get("status") == "DEPLOY_FAILED":
                raise AssertionError(f"deploy failed: {json.dumps(app, indent=1)[:3000]}")
        time.sleep(2)
    raise AssertionError(f"app not RUNNING after {timeout} s: {status}\n" + "\n".join(c.log[-3:]))


def test_ray_up_serve_deploy_stream_ray_down(cluster: LocalCluster, tiny_models):
    c = cluster
    timings = {"ray up": c.up()}
    assert cluster_processes(c.id), "ray up started no Ray process with the cluster's marker"

    http_port = free_port()
    t = time.time()
    out = c.serve("deploy", _serve_config(c, tiny_models, http_port), "-a", c.dashboard)
    assert out.returncode == 0, "\n".join(c.log)
    app = _wait_running(c)
    timings["serve deploy -> RUNNING"] = time.time() - t
    assert set(app["deployments"]) >= {"Ingress", "Coordinator", "Drafter", "Target", "EmbeddedRedis"}

    # The head-only resource pins Ingress, Coordinator and the embedded Redis, as on AWS.
    status = c.ray("status", "--address", f"127.0.0.1:{c.gcs_port}").stdout
    used = [line for line in status.splitlines() if "specserve_head" in line]
    assert used and used[0].strip().startswith("3.0/1000.0"), status

    t = time.time()
    models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).json()["data"]
    body = {"model": models[0]["id"], "prompt": [1, 5, 9, 14, 3], "max_tokens": 24, "ignore_eos": True,
            "stream": True, "temperature": 0.0}
    chunks, usage, spec, done = [], None, None, False
    with httpx.stream("POST", f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event.get("choices"):
                chunks.append(event["choices"][0])
            if event.get("usage"):
                usage, spec = event["usage"], event.get("speculation")
    timings["streamed request"] = time.time() - t
    assert done and usage["completion_tokens"] == 24
    assert chunks[-1]["finish_reason"] == "length"
    assert spec["target_passes"] >= 1 and spec["drafted"] >= spec["accepted"] >= 0

    timings["ray down"] = c.down()
    time.sleep(1)
    assert cluster_processes(c.id) == [], "ray down left processes of the cluster running"
    assert not port_open(http_port) and not port_open(c.dashboard_port) and not port_open(c.gcs_port)
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
