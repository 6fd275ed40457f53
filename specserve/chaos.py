"""Fault campaign: kill and restart each part of the serving stack under a load of seeded streaming requests, and
check that no request, no token and no seeded output is lost.

For each setup (one Serve app on a local Ray, started here) the same request set runs once without faults (the
reference), then once per fault, with the fault injected when about a quarter of the tokens have streamed:

    fault         setup     what is killed (SIGKILL of its process unless said)
    drafter       base      the worker actor of one drafter replica (two replicas)
    target        base      the worker actor of the target replica (rank 0)
    coordinator   base      one coordinator replica's actor (two replicas)
    redis         base      the embedded redis-server (Serve replaces its replica; the new one is empty)
    proxy         base      Ray Serve's HTTP proxy actor (Serve restarts it on the same port)
    tp-rank       tp2       rank 1 of a tensor-parallel (TP=2, gloo on CPU) target replica
    redis-aof     aof       an external redis-server with AOF on, restarted on the same port and dir

Requests alternate greedy and seeded sampled; each is a stream (`/v1/completions`, `stream: true`,
`ignore_eos`) whose client reconnects with `Last-Event-ID: {request id}:{last index}` when its connection drops,
and re-sends a request that failed before the server gave it an id. Per fault: requests completed, resumed
(Last-Event-ID reconnects), retried (re-sent), server errors seen, outputs whose token ids or text differ from the
reference, tokens lost or duplicated (missing or repeated event indices, and length against the reference), the
time from the kill to the next token of every stream that was running (recovery) and until the killed part
answers again (health).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx

from specserve.loadgen import DEFAULT_PROMPTS, LoadConfig, _body, _chunk_text

APP = "chaos"
WORKERS = "specserve-workers"
SETUPS = {
    "base": ("drafter", "target", "coordinator", "redis", "proxy"),
    "tp2": ("tp-rank",),
    "aof": ("redis-aof",),
}
FAULTS = tuple(f for faults in SETUPS.values() for f in faults)
SERVER_ERROR_CODES = (500, 502, 503, 504)


@dataclass
class ChaosConfig:
    target: Optional[str] = None  # model folder; None: the demo target
    draft: Optional[str] = None  # drafter word; None: `specserve serve`'s default for the target
    faults: Sequence[str] = FAULTS
    concurrency: int = 16  # streams at once
    num_requests: int = 32  # closed loop: each stream sends the next request when its last one ends
    max_tokens: int = 32
    temperature: float = 0.8  # of the sampled half (odd request indices); the even half is greedy
    seed: int = 0
    num_draft_tokens: int = 3
    max_seq_len: int = 512
    drafter_replicas: int = 2  # a killed drafter fails over to another (with 1: target-only steps, which change
    # sampled outputs)
    trigger: float = 0.25  # inject the fault when this share of the expected tokens has streamed
    timeout_s: float = 300.0  # per request, resumes included
    health_timeout_s: float = 180.0  # how long to wait for the killed part to come back
    prompts: Optional[Sequence[Any]] = None  # strings or token id lists; None: built in (ids without a tokenizer)

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}")
        if self.concurrency < 1 or self.num_requests < 1 or self.max_tokens < 1:
            raise ValueError("concurrency, num_requests and max_tokens must be >= 1")
        if not 0 < self.trigger < 1:
            raise ValueError(f"trigger must be in (0, 1), got {self.trigger}")


# -- the client -------------------------------------------------------------------------------------------

@dataclass
class Stream:
    """One request as its client saw it, across reconnects."""

    index: int
    request_id: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # monotonic time of each content event
    started: float = 0.0
    finished: Optional[float] = None
    ok: bool = False
    completion_tokens: Optional[int] = None  # the server's usage
    resumed: int = 0  # reconnects with Last-Event-ID (tries, also those refused while the proxy is down)
    retried: int = 0  # re-sent from scratch (no request id yet)
    errors: list[str] = field(default_factory=list)  # server errors seen (HTTP 5xx, error events)
    drops: int = 0  # connections that broke without an error
    missing_events: int = 0  # event indices skipped
    duplicate_events: int = 0
    duplicate_tokens: int = 0
    last_index: int = -1


def request_body(config: ChaosConfig, model: str, prompt: Any, index: int) -> dict[str, Any]:
    """Even indices greedy, odd seeded sampled (top_p 0.95); the body `specserve load` sends otherwise."""
    load = LoadConfig(model=model, max_tokens=config.max_tokens, endpoint="completions", ignore_eos=True,
                      seed=config.seed, temperature=0.0 if index % 2 == 0 else config.temperature,
                      num_draft_tokens=config.num_draft_tokens)
    body = _body(load, model, prompt, index)
    if index % 2:
        body["top_p"] = 0.95
    return body


async def run_stream(client: httpx.AsyncClient, body: dict[str, Any], rec: Stream, timeout_s: float,
                     on_tokens: Callable[[int], None] = lambda n: None) -> None:
    """Stream one request to its end, reconnecting with Last-Event-ID when the connection drops."""
    rec.started = time.monotonic()
    deadline = rec.started + timeout_s
    backoff = 0.2
    while time.monotonic() < deadline:
        headers, payload = {}, body
        if rec.request_id is not None:
            headers, payload = {"Last-Event-ID": f"{rec.request_id}:{rec.last_index}"}, {}
        done = False
        try:
            async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    if resp.status_code in SERVER_ERROR_CODES:
                        rec.errors.append(f"HTTP {resp.status_code}: {text}")
                    elif resp.status_code == 404 and rec.request_id is not None and rec.last_index < 0:
                        rec.errors.append(f"HTTP 404 on resume before any token: {text}")
                        rec.request_id = None  # never stored: send it again
                    else:
                        rec.errors.append(f"HTTP {resp.status_code}: {text}")
                        return
                else:
                    rec.request_id = rec.request_id or resp.headers.get("x-request-id")
                    done = await _read_events(resp, rec, on_tokens)
        except (httpx.TransportError, httpx.StreamError):
            rec.drops += 1
        if done:
            rec.ok = True
            rec.finished = time.monotonic()
            return
        if rec.request_id is None:
            rec.retried += 1
        else:
            rec.resumed += 1
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 2.0)
    rec.errors.append(f"not finished within {timeout_s} s")


async def _read_events(resp: httpx.Response, rec: Stream, on_tokens: Callable[[int], None]) -> bool:
    """Read one SSE response; True if it ended with [DONE] after the final chunk."""
    eid: Optional[str] = None
    finished = False
    async for line in resp.aiter_lines():
        if line.startswith("id:"):
            eid = line[3:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return finished
        event = json.loads(data)
        if "error" in event:
            rec.errors.append(f"stream error: {event['error'].get('message', event['error'])}"[:300])
            return False
        choices = event.get("choices") or []
        if event.get("usage"):
            rec.completion_tokens = event["usage"].get("completion_tokens")
        if not choices or eid is None:
            eid = None
            continue
        rid, _, index = eid.rpartition(":")
        rec.request_id, i, eid = rid, int(index), None
        ids = choices[0].get("token_ids") or []
        if i <= rec.last_index:
            rec.duplicate_events += 1
            rec.duplicate_tokens += len(ids)
            continue
        rec.missing_events += i - rec.last_index - 1
        rec.last_index = i
        rec.token_ids += ids
        rec.text += _chunk_text(event) or ""
        rec.token_times.append(time.monotonic())
        on_tokens(len(ids))
        if choices[0].get("finish_reason"):
            finished = True
    return False


def default_prompts(has_tokenizer: bool, count: int = 8) -> list[Any]:
    if has_tokenizer:
        return list(DEFAULT_PROMPTS)
    return [[1 + i, 7 + 3 * i, 11 + i, 40 + 5 * i, 3 + 2 * i] for i in range(count)]  # token ids (vocab >= 128)


async def run_load(url: str, model: str, config: ChaosConfig, prompts: Sequence[Any],
                   fault: Optional[Callable[[], Any]] = None) -> tuple[list[Stream], Optional[float]]:
    """The request set, `concurrency` streams at a time; `fault` (blocking, run in a thread) is called once a
    `trigger` share of the expected tokens has streamed. Returns (streams by index, monotonic time of the kill)."""
    expected = config.num_requests * config.max_tokens
    streams = [Stream(index=i) for i in range(config.num_requests)]
    state = {"tokens": 0, "kill_at": None}
    fired = asyncio.Event()

    def on_tokens(n: int) -> None:
        state["tokens"] += n
        if state["tokens"] >= config.trigger * expected:
            fired.set()

    async def injector() -> None:
        if fault is None:
            return
        await fired.wait()
        state["kill_at"] = time.monotonic()
        await asyncio.to_thread(fault)

    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.timeout_s, connect=5.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        queue = list(range(config.num_requests))

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                body = request_body(config, model, prompts[i % len(prompts)], i)
                await run_stream(client, body, streams[i], config.timeout_s, on_tokens)

        inject = asyncio.ensure_future(injector())
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        if fault is not None and not inject.done():
            fired.set()  # the load ended before the trigger (tiny loads): kill now, after it
        await inject
    return streams, state["kill_at"]


# -- judging ----------------------------------------------------------------------------------------------

def judge(fault: str, streams: Sequence[Stream], reference: Sequence[Stream], kill_at: Optional[float],
          health_s: Optional[float]) -> dict[str, Any]:
    """One row of the table: the run of `fault` against the fault-free `reference` run."""
    mismatches, lost, duplicated = [], 0, 0
    for got, want in zip(streams, reference):
        lost += max(0, len(want.token_ids) - len(got.token_ids))
        duplicated += got.duplicate_tokens + max(0, len(got.token_ids) - len(want.token_ids))
        if got.token_ids != want.token_ids or got.text != want.text or (
                got.completion_tokens is not None and got.completion_tokens != len(got.token_ids)):
            mismatches.append(got.index)
    row: dict[str, Any] = {
        "fault": fault, "requests": len(streams), "completed": sum(s.ok for s in streams),
        "resumed": sum(s.resumed > 0 for s in streams), "reconnects": sum(s.resumed for s in streams),
        "retried": sum(s.retried for s in streams),
        "server_errors": sum(len(s.errors) for s in streams), "mismatches": len(mismatches),
        "lost_tokens": lost, "duplicated_tokens": duplicated,
        "missing_events": sum(s.missing_events for s in streams),
        "duplicate_events": sum(s.duplicate_events for s in streams),
        "recovery_s": recovery_s(streams, kill_at), "health_s": health_s,
    }
    row["ok"] = (row["completed"] == row["requests"] and not mismatches and not lost and not duplicated
                 and not row["missing_events"] and not row["duplicate_events"] and not row["server_errors"])
    row["mismatched_requests"] = mismatches
    row["errors"] = sorted({e for s in streams for e in s.errors})[:10]
    return row


def recovery_s(streams: Sequence[Stream], kill_at: Optional[float]) -> Optional[float]:
    """Kill -> the next token of every stream that was running at the kill (the slowest one)."""
    if kill_at is None:
        return None
    waits = []
    for s in streams:
        running = s.started <= kill_at and (s.finished is None or s.finished > kill_at)
        after = [t for t in s.token_times if t > kill_at]
        if running and after:
            waits.append(after[0] - kill_at)
    return round(max(waits), 2) if waits else None


COLUMNS = ("fault", "requests", "completed", "resumed", "reconnects", "retried", "server_errors", "mismatches",
           "lost_tokens", "duplicated_tokens", "recovery_s", "health_s", "ok")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "**no**"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


# -- the stack and its faults -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExternalRedis:
    """A redis-server this campaign starts with AOF on, and can SIGKILL and restart on the same port and dir."""

    def __init__(self) -> None:
        from deployments.embedded_redis import find_redis_server

        self.binary = find_redis_server()
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="specserve-chaos-redis-")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "ExternalRedis":
        from deployments.redis_conn import ping

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--appendonly", "yes",
             "--save", "", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not ping(self.url, timeout_s=0.2):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def campaign_draft(target: Optional[str]) -> str:
    """The campaign's default drafter: for the demo target its distilled draft model behind prompt lookup, whose
    drafter replicas the drafter faults kill (the default drafter, a head in the target worker, has none); for any
    other target its default."""
    from pipeline.config import HYBRID_PREFIX
    from pipeline.engine import default_draft
    from pipeline.models.store import DEMO_DRAFT, DEMO_TARGET

    return HYBRID_PREFIX + DEMO_DRAFT if target in (None, DEMO_TARGET) else default_draft(target)


def app_config(config: ChaosConfig, setup: str, redis_url: Optional[str]) -> dict[str, Any]:

    slots = config.concurrency + 4
    draft = config.draft or campaign_draft(config.target)
    drafter: dict[str, Any] = {"draft": draft, "max_batch_size": slots,
                               "resources": {"num_replicas": config.drafter_replicas}}
    target: dict[str, Any] = {"model": config.target, "max_seq_len": config.max_seq_len, "max_batch_size": slots}
    if setup == "tp2":
        target.update(tensor_parallel_size=2, resources={"num_cpus": 0.01})  # bundles must claim something
    cfg: dict[str, Any] = {
        "target": target, "drafter": drafter, "coordinator": {"num_replicas": 2, "replica_wait_s": 120},
        "speculation": {"num_draft_tokens": config.num_draft_tokens},
    }
    if redis_url:
        cfg["redis_url"] = redis_url
    return cfg


def _actor_pid(handle: Any) -> int:
    import ray

    return int(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def _named(prefix: str, namespace: Optional[str] = None) -> list[dict[str, str]]:
    import ray

    return sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(prefix) and (namespace is None or a["namespace"] == namespace)),
                  key=lambda a: a["name"])


def _replica_actors(deployment: str) -> list[dict[str, str]]:
    import ray

    return sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                   if f"{APP}#{deployment}#" in a["name"]), key=lambda a: a["name"])


def _get(actor: dict[str, str]) -> Any:
    import ray

    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


class Fault:
    """A kill prepared before the load (victim and PID found while idle) and a check that the part is back."""

    def __init__(self, name: str, url: str, external: Optional[ExternalRedis], replicas: int) -> None:
        self.name, self.url, self.external, self.replicas = name, url, external, replicas
        self.victim, self.pid = self._pick()

    def _pick(self) -> tuple[Any, Optional[int]]:
        n = self.name
        if n in ("drafter", "target", "tp-rank"):
            role, rank = {"drafter": ("Drafter", 0), "target": ("Target", 0), "tp-rank": ("Target", 1)}[n]
            workers = [a for a in _named(f"{APP}:{role}:", WORKERS) if a["name"].endswith(f":{rank}")]
            if not workers:
                raise RuntimeError(f"no {role} worker of rank {rank} to kill")
            return workers[0]["name"], _actor_pid(_get(workers[0]))
        if n == "coordinator":
            replicas = _replica_actors("Coordinator")
            return replicas[0]["name"], _actor_pid(_get(replicas[0]))
        if n == "proxy":
            from ray.serve._private.constants import SERVE_PROXY_NAME

            proxies = _named(SERVE_PROXY_NAME)
            return proxies[0]["name"], _actor_pid(_get(proxies[0]))
        if n == "redis":
            import redis as redis_client
            from ray import serve

            url = serve.get_deployment_handle("EmbeddedRedis", APP).url.remote().result()
            pid = int(redis_client.Redis.from_url(url).info("server")["process_id"])
            return url, pid
        assert n == "redis-aof" and self.external is not None
        return self.external.url, self.external.proc.pid

    def inject(self) -> None:
        if self.name == "redis-aof":
            self.external.kill()
            time.sleep(1.0)  # down for a second, then back on the same port, from the same AOF
            self.external.start()
        else:
            _sigkill(self.pid)

    def recovered(self) -> bool:
        """Whether the killed part (or its replacement) answers."""
        try:
            if self.name == "proxy":
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            if self.name == "redis-aof":
                return _redis_answers(self.victim)
            if self.name == "redis":
                from ray import serve

                url = serve.get_deployment_handle("EmbeddedRedis", APP).url.remote().result(timeout_s=5)
                return url != self.victim and _redis_answers(url) and _app_running()
            if self.name == "coordinator":
                return len(_replica_actors("Coordinator")) >= 2 and self.victim not in {
                    a["name"] for a in _replica_actors("Coordinator")} and _app_running()
            role, rank = {"drafter": ("Drafter", 0), "target": ("Target", 0), "tp-rank": ("Target", 1)}[self.name]
            names = [a["name"] for a in _named(f"{APP}:{role}:", WORKERS) if a["name"].endswith(f":{rank}")]
            want = self.replicas if role == "Drafter" else 1
            return len(names) >= want and self.victim not in names and _app_running()
        except Exception:  # noqa: BLE001 - not back yet
            return False


def _redis_answers(url: str) -> bool:
    import redis as redis_client

    return bool(redis_client.Redis.from_url(url, socket_timeout=2).ping())


def _app_running() -> bool:
    from ray import serve

    app = serve.status().applications.get(APP)
    return app is not None and str(app.status).endswith("RUNNING")


def wait_recovered(fault: Fault, since: float, timeout_s: float) -> Optional[float]:
    """Seconds from `since` (the kill) until the killed part is back; None if it is not within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fault.recovered():
            return round(time.monotonic() - since, 2)
        time.sleep(0.25)
    return None


# -- the campaign -----------------------------------------------------------------------------------------

def run_setup(config: ChaosConfig, setup: str, faults: Sequence[str], http_port: int,
              log: Callable[[str], None], on_row: Callable[[dict[str, Any]], None] = lambda row: None,
              ) -> list[dict[str, Any]]:
    from ray import serve

    from deployments.app import build_app
    from pipeline.models.loader import load_tokenizer

    external = ExternalRedis().start() if setup == "aof" else None
    url = f"http://127.0.0.1:{http_port}"
    rows = []
    try:
        log(f"[{setup}] deploying ...")
        serve.run(build_app(app_config(config, setup, external.url if external else None)), name=APP,
                  route_prefix="/", blocking=False)
        _wait_app(config.health_timeout_s)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompts = list(config.prompts or default_prompts(load_tokenizer(config.target) is not None))
        log(f"[{setup}] reference run ({config.num_requests} requests, {config.concurrency} streams) ...")
        t0 = time.monotonic()
        reference, _ = asyncio.run(run_load(url, model, config, prompts))
        log(f"[{setup}] reference: {sum(s.ok for s in reference)}/{len(reference)} in {time.monotonic() - t0:.1f} s")
        rows.append(judge(f"none ({setup})", reference, reference, None, None))
        on_row(rows[-1])
        for name in faults:
            fault = Fault(name, url, external, config.drafter_replicas)
            log(f"[{setup}] fault {name}: {fault.victim} (pid {fault.pid}) ...")
            streams, kill_at = asyncio.run(run_load(url, model, config, prompts, fault.inject))
            health = wait_recovered(fault, kill_at, config.health_timeout_s) if kill_at else None
            row = judge(name, streams, reference, kill_at, health)
            rows.append(row)
            on_row(row)
            log(f"[{setup}] {name}: " + ", ".join(f"{c}={row[c]}" for c in COLUMNS[1:]))
            _wait_app(config.health_timeout_s)
    finally:
        try:
            serve.delete(APP)
        finally:
            if external is not None:
                external.stop()
    return rows


def _wait_app(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _app_running():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app is not RUNNING after {timeout_s} s")
        time.sleep(0.5)


def run_campaign(config: ChaosConfig, out_dir: Optional[str | Path] = "load-out/chaos",
                 log: Callable[[str], None] = print, http_port: Optional[int] = None) -> list[dict[str, Any]]:
    """Run each setup's faults, write chaos.json and chaos.md; return the rows. Starts Ray and Serve here, unless
    `http_port` names the port of a Serve already running in this process's Ray (tests)."""
    import ray
    from ray import serve

    from deployments.config import DrafterConfig
    from deployments.ray_env import apply_ray_defaults
    from pipeline.models.store import resolve

    apply_ray_defaults()
    # Models resolved (on first use downloaded and converted) once here, as `specserve serve` does.
    drafter = DrafterConfig(draft=config.draft or campaign_draft(config.target))
    config.draft = drafter.with_model(str(resolve(drafter.model))).draft if drafter.uses_model else drafter.draft
    config.target = str(resolve(config.target))
    started = http_port is None
    port = http_port or free_port()
    if started:
        ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
    rows: list[dict[str, Any]] = []
    meta = {k: v for k, v in asdict(config).items() if k != "prompts"}

    def write(row: dict[str, Any]) -> None:  # after every row: a campaign cut short keeps what it measured
        rows.append(row)
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "chaos.json").write_text(json.dumps({"config": meta, "rows": rows}, indent=2))
            (out / "chaos.md").write_text(markdown_table(rows) + "\n")

    try:
        for setup, faults in SETUPS.items():
            chosen = [f for f in config.faults if f in faults]
            if chosen:
                run_setup(config, setup, chosen, port, log, write)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
    return rows
