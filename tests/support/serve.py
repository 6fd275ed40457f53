"""Helpers for the Serve tests: one local Ray cluster + Serve instance per test session (started on first
use, stopped at exit), SSE parsing, and finding/killing replicas. Not a conftest: the serve test modules
import it explicitly."""

from __future__ import annotations

import atexit
import json
import socket
import time
from typing import Any, Iterator, Optional

from deployments.ray_env import apply_ray_defaults
from pipeline.config import EngineConfig
from pipeline.drafters import HybridDrafter, ModelDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model

apply_ray_defaults()

_PORT: Optional[int] = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_serve() -> str:
    """Start Ray (2 CPUs, no dashboard) and Serve once; returns the HTTP base URL."""
    global _PORT
    import ray  # ray where it is used (here and below): the module's other helpers stay light to import
    from ray import serve

    if _PORT is None:
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        _PORT = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": _PORT})

        atexit.register(stop_serve)
    return f"http://127.0.0.1:{_PORT}"


def stop_serve() -> None:
    """Stop this process's Serve and Ray, if up (at exit, and when a group of Serve tests ends: tests/conftest.py).
    An idle Ray with its apps keeps a share of a core busy; a later ensure_serve starts a fresh one."""
    global _PORT
    import ray
    from ray import serve

    from tests.support import edge_app, small_app

    edge_app.forget()
    small_app.forget()
    if _PORT is None and not ray.is_initialized():
        return
    _PORT = None
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()


def run_app(app: Any, name: str) -> str:
    """Deploy `app` under /{name}; returns its base URL (ending without a slash)."""
    from ray import serve

    base = ensure_serve()
    serve.run(app, name=name, route_prefix=f"/{name}")
    return f"{base}/{name}"


def redis_url(app_name: str) -> str:
    from ray import serve

    return serve.get_deployment_handle("EmbeddedRedis", app_name).url.remote().result()


def replica_actor(app: str, deployment: str, replica_id: str):
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].endswith(f"{app}#{deployment}#{replica_id}"):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(f"no replica {replica_id} of {app}/{deployment}")


def sse_events(lines: Iterator[str]) -> Iterator[tuple[Optional[str], Any]]:
    """(event id, parsed data) per SSE event; data "[DONE]" is yielded as the string."""
    eid, data = None, []
    for line in lines:
        if line.startswith("id: "):
            eid = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            payload = "\n".join(data)
            yield eid, payload if payload == "[DONE]" else json.loads(payload)
            eid, data = None, []
    if data:
        payload = "\n".join(data)
        yield eid, payload if payload == "[DONE]" else json.loads(payload)


def stream_steps(url: str, body: dict, headers: Optional[dict] = None) -> tuple[list[list[int]], dict]:
    """POST a streamed /v1/completions (or a resume with `Last-Event-ID` in `headers`) and read it to [DONE] ->
    (the token ids of each event, the final usage chunk). Any error event or non-200 status fails the test."""
    import httpx

    steps: list[list[int]] = []
    final: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for _, data in sse_events(r.iter_lines()):
            if data == "[DONE]":
                break
            assert "error" not in data, data
            if data["choices"]:
                steps.append(data["choices"][0]["token_ids"])
            else:
                final = data
    return steps, final


def stream_completion(url: str, body: dict, headers: Optional[dict] = None) -> tuple[list[int], dict]:
    """`stream_steps` -> (the token ids of every event, in one list; the final usage chunk)."""
    steps, final = stream_steps(url, body, headers)
    return [t for step in steps for t in step], final


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval_s)


def tiny_engine(tiny_models: dict, max_batch_size: int, max_seq_len: int, hybrid: bool = False):
    """The in-process reference for the Serve tests: the tiny llama target with the tiny model drafter (behind
    prompt lookup with `hybrid`, as the Serve app's drafter.draft 'lookup+MODEL')."""
    target, _ = load_model(str(tiny_models["llama"]))
    draft, _ = load_model(str(tiny_models["draft"]))
    drafter = HybridDrafter(ModelDrafter(draft)) if hybrid else ModelDrafter(draft)
    return SpeculativeEngine(target, None, drafter,
                             EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len))


def read_until(proc: Any, marker: str) -> str:
    """What a server process (text stdout) printed up to and including the line with `marker`; fails the test
    with that output if the process ends first."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            break
    text = "".join(seen)
    assert marker in text, text
    return text
