"""API keys: OpenAI's `Authorization: Bearer KEY` on every /v1 route, a 401 with OpenAI's body otherwise, /health
open; keys from the config, `--api-key` or SPECSERVE_API_KEY, never printed; `specserve serve` refuses to listen
beyond loopback without one. The HTTP tests use the real `openai` client and httpx against real Serve."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import httpx
import pytest

from deployments.config import AppConfig, IngressConfig
from specserve import cmd_serve
from tests.support import ROOT
from tests.support.edge_app import AUTH, KEY, MODEL, edge_app

UNAUTHORIZED = {"type": "invalid_request_error", "code": "invalid_api_key", "param": None}


# -- the config and the CLI (no server) ------------------------------------------------------------------------

def test_keys_never_print_and_reach_the_replicas_only_through_build_apps_dump():
    cfg = AppConfig.model_validate({"ingress": {"api_keys": ["k-secret-1", "k-secret-2"]}})
    for shown in (str(cfg), repr(cfg), cfg.model_dump_json(), json.dumps(cfg.model_dump(mode="json"))):
        assert "k-secret" not in shown and "**********" in shown
    revealed = cfg.model_dump(mode="json", context={"reveal_secrets": True})
    assert revealed["ingress"]["api_keys"] == ["k-secret-1", "k-secret-2"]
    again = AppConfig.model_validate(revealed)  # what the ingress replica rebuilds
    assert [k.get_secret_value() for k in again.ingress.api_keys] == ["k-secret-1", "k-secret-2"]


@pytest.mark.parametrize("bad", ["", " padded ", "tab\tkey", "ключ"])
def test_a_key_that_cannot_travel_in_a_header_is_refused(bad):
    with pytest.raises(ValueError, match="printable ASCII"):
        IngressConfig(api_keys=[bad])


def test_the_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", "k1, k2,,")
    assert [k.get_secret_value() for k in IngressConfig().api_keys] == ["k1", "k2"]
    assert IngressConfig(api_keys=[]).api_keys == []  # the config wins
    monkeypatch.delenv("SPECSERVE_API_KEY")
    assert IngressConfig().api_keys == []


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--draft", "prompt-lookup", *argv])


def test_api_key_flags_repeat_and_take_comma_lists(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    cfg = cmd_serve.load_config(_serve_args("--api-key", "a,b", "--api-key", "c"))
    assert [k.get_secret_value() for k in cfg.ingress.api_keys] == ["a", "b", "c"]
    assert cmd_serve.load_config(_serve_args()).ingress.api_keys == []


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.1.2.3", False), ("example.com", False)])
def test_a_host_beyond_loopback_needs_a_key(monkeypatch, host, loopback):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    keyless = cmd_serve.load_config(_serve_args())
    if loopback:
        cmd_serve.check_exposure(host, keyless)
    else:
        with pytest.raises(ValueError, match="without an API key"):
            cmd_serve.check_exposure(host, keyless)
    cmd_serve.check_exposure(host, cmd_serve.load_config(_serve_args("--api-key", "k")))


def test_serve_on_all_interfaces_without_a_key_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "specserve", "serve", "--host", "0.0.0.0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "specserve serve: error: refusing to serve on 0.0.0.0 without an API key: pass --api-key KEY (or set "
        "SPECSERVE_API_KEY, or ingress.api_keys in the config), or serve on 127.0.0.1"], done.stderr
    assert "starting Ray" not in done.stdout


# -- the running server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(demo_path):
    return edge_app(demo_path)


@pytest.mark.slow
def test_the_openai_client_with_the_key_is_served(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert done.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert chunks and chunks[-1].usage.completion_tokens >= 1


@pytest.mark.slow
@pytest.mark.parametrize("key", ["wrong-key", KEY + "x", KEY[:-1]])
def test_the_openai_client_with_a_wrong_key_gets_401(server, key):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert caught.value.status_code == 401
    err = caught.value.body
    assert {k: err[k] for k in UNAUTHORIZED} == UNAUTHORIZED and err["message"] == "Incorrect API key provided."
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.slow
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions")])
@pytest.mark.parametrize("authorization", [None, "", "Bearer", f"Basic {KEY}", KEY, "Bearer wrong"])
def test_every_v1_route_needs_the_key(server, method, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    body = {"model": MODEL, "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.request(method, f"{server}{path}", json=body if method == "POST" else None, headers=headers,
                      timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and {k: err[k] for k in UNAUTHORIZED} == UNAUTHORIZED


@pytest.mark.slow
def test_health_stays_open_and_the_scheme_is_case_blind(server):
    assert httpx.get(f"{server}/health", timeout=30).json()["status"] == "ok"
    r = httpx.get(f"{server}/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server}/v1/models", headers=AUTH, timeout=30).status_code == 200
