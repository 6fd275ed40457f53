"""The observability files in ops/deploy/ fit together (no Docker here to run them; the ray-up test scrapes a
real cluster for every metric the dashboard uses)."""

from __future__ import annotations

import json
import re

import yaml

from deployments import metrics
from tests.support import ROOT

OPS = ROOT / "ops" / "deploy"


def test_compose_services_ports_and_mounted_files():
    compose = yaml.safe_load((OPS / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"jaeger", "redis", "prometheus", "grafana"}
    assert {"4317:4317", "4318:4318", "16686:16686"} <= set(services["jaeger"]["ports"])  # OTLP gRPC/HTTP, UI
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (OPS / source).exists(), f"{name} mounts {source}, which is not in ops/deploy/"


def test_prometheus_scrapes_the_metrics_port_of_specserve_serve():
    from specserve.cmd_serve import DEFAULT_METRICS_PORT

    text = (OPS / "prometheus.yml").read_text()
    config = yaml.safe_load(text)
    (ray_job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    assert ray_job["static_configs"][0]["targets"] == [f"localhost:{DEFAULT_METRICS_PORT}"]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in text  # the cluster variant, in a comment


def test_dashboard_queries_name_metrics_that_exist():
    datasource = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    dash = json.loads((OPS / "grafana/specserve.json").read_text())
    ours = set()
    for name, d in metrics.DEFS.items():
        suffixes = ("_bucket", "_sum", "_count") if d.kind == "histogram" else ("",)
        ours |= {f"ray_{name}{s}" for s in suffixes}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    used = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\bray_[a-z_]+", target["expr"]):
                used.add(name)
                assert name in ours or name.startswith("ray_serve_"), f"{panel['title']}: unknown {name}"
    # Every specserve metric family is on the dashboard (ttft, itl, acceptance, ...).
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert {f"ray_{n}" for n in metrics.DEFS} <= families | {"ray_specserve_prompt_tokens_total",
                                                              "ray_specserve_request_latency_seconds"}


def test_make_serve_installs_no_os_package_and_make_test_adds_the_ssh_extras():
    import shutil
    import subprocess

    import pytest

    if not shutil.which("make"):
        pytest.skip("no make on this machine")

    def commands(target: str) -> list[str]:  # what `make TARGET` would run (dry run)
        out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.splitlines()

    serve, test = commands("serve"), commands("test")
    assert "./ops/setup_ci_extras.sh" not in serve and "./ops/setup.sh" in serve
    assert "./ops/setup_ci_extras.sh" in test
    code = [line for line in (ROOT / "ops" / "setup.sh").read_text().splitlines() if not line.startswith("#")]
    assert not [line for line in code if "apt-get" in line or "setup_ci_extras" in line]
