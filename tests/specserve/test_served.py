"""One real `specserve serve` on the demo models (the default drafter, an API key), in its own session, checked as a
user and a process manager meet it, in this order:
- what it opens to the network: every listening socket of its processes (the driver, Ray's daemons and workers, the
  embedded Redis) is on loopback, except the ones the README's "What listens where" names with their protection;
  Ray's own endpoints answer only to the cluster's token, and the embedded Redis only to its password;
- the `openai` client with the key is served, one without it gets 401, and the key is printed nowhere;
- a SIGTERM to its whole process group (`timeout`, a systemd stop), which reaches Ray's own daemons too, stops it
  fast and leaves no process behind.
(Ctrl-C on a running server is the soak's way of stopping it: tests/ops/test_soak.py.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import redis

from deployments.ray_env import LOCAL_RAY_DEFAULTS, ray_environment
from tests.specserve.test_serve_signals import assert_session_empty
from tests.support.serve import read_until

pytestmark = pytest.mark.slow

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
WILDCARD = {"0.0.0.0", "::"}
KEY = "sk-cli-test-3f9a1c"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def _listeners(procs: list[psutil.Process]) -> list[tuple[str, int, str, list[str]]]:
    """(ip, port, process name, command line) of every listening TCP socket of `procs`."""
    out = []
    for p in procs:
        try:
            cmd = p.cmdline()
            for c in p.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((c.laddr.ip, c.laddr.port, p.name(), cmd))
        except psutil.Error:
            pass
    return out


def _flag(cmds: list[list[str]], name: str) -> set[int]:
    """Values of `--name=N` (or `--name N`) across the command lines."""
    found = set()
    for cmd in cmds:
        for i, arg in enumerate(cmd):
            m = re.fullmatch(rf"--{name}=(\d+)", arg)
            if m:
                found.add(int(m.group(1)))
            elif arg == f"--{name}" and i + 1 < len(cmd) and cmd[i + 1].isdigit():
                found.add(int(cmd[i + 1]))
    return found


@pytest.fixture(scope="module")
def served():
    port = _free_port()
    env = dict(ray_environment(), PYTHONUNBUFFERED="1")
    env.pop("SPECSERVE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(port), "--api-key", KEY],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    watchdog = threading.Timer(400, lambda: os.killpg(proc.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        yield {"proc": proc, "pid": proc.pid, "port": port, "out": read_until(proc, "Press Ctrl-C")}
    finally:
        if proc.poll() is None:  # the last test stops it; this is for a test that failed before
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=120)
        watchdog.cancel()


def _ray_worker(name: str) -> bool:
    """A Ray worker process. Ray's gRPC servers (GCS, raylet, workers, the driver's core worker) listen on loopback
    with the node address 127.0.0.1, except Serve's inter-deployment gRPC server in every replica, which Serve binds to
    every interface ("[::]:0"); Ray's token guards it like every Ray gRPC server (the next test)."""
    return name.startswith("ray::")


def test_every_listener_is_on_loopback_or_protected(served):
    procs = _session_processes(served["pid"])
    found = _listeners(procs)
    assert ("127.0.0.1", served["port"]) in {(ip, port) for ip, port, _, _ in found}, found
    cmds = [p.cmdline() for p in procs if p.is_running()]
    # The metrics ports (Ray's metrics agent and export port) have their own row in the README ("see metrics").
    metrics = _flag(cmds, "metrics_export_port") | _flag(cmds, "metrics-agent-port") | _flag(cmds, "metrics_agent_port")
    open_doors = [(ip, port, name) for ip, port, name, _ in found
                  if ip not in LOOPBACK and port not in metrics and not (ip in WILDCARD and _ray_worker(name))]
    assert not open_doors, f"listening beyond loopback, unguarded: {open_doors}"
    redis_ports = [port for ip, port, name, _ in found if "redis-server" in name]
    assert len(redis_ports) == 1, found
    client = redis.Redis(host="127.0.0.1", port=redis_ports[0], socket_timeout=2)
    with pytest.raises(redis.exceptions.AuthenticationError):  # the embedded Redis wants its password
        client.keys("*")
    client.close()


def test_ray_of_specserve_serve_wants_its_token(served):
    """The local Ray runs with token authentication: a client with a wrong token is refused, the right one (in
    ~/.ray/auth_token, where `ray.init` put it) is let in."""
    procs = _session_processes(served["pid"])
    gcs = [p for p in procs if p.name() == "gcs_server"]
    assert gcs, [p.name() for p in procs]
    assert gcs[0].environ().get("RAY_AUTH_MODE") == "token"
    ports = {p for p in _flag([gcs[0].cmdline()], "gcs_server_port") if p} or {
        port for _, port, _, _ in _listeners(gcs)}
    gcs_port = min(ports)
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    # As a client on this machine: Ray's one-machine mode, or the CLI swaps 127.0.0.1 for the machine's address.
    base = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}, **LOCAL_RAY_DEFAULTS}
    try:
        wrong = subprocess.run([ray_cli, "status", "--address", f"127.0.0.1:{gcs_port}"], capture_output=True,
                               text=True, timeout=60,
                               env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32})
        assert wrong.returncode != 0, wrong.stdout
    except subprocess.TimeoutExpired:
        pass  # still retrying, never let in
    right = subprocess.run([ray_cli, "status", "--address", f"127.0.0.1:{gcs_port}"], capture_output=True,
                           text=True, timeout=60, env={**base, "RAY_AUTH_MODE": "token"})
    assert right.returncode == 0, right.stdout + right.stderr


def test_the_api_key_guards_the_server(served):
    import openai

    base = f"http://127.0.0.1:{served['port']}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert done.usage.completion_tokens >= 1
    stranger = openai.OpenAI(base_url=base, api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model=model, prompt="Hello", max_tokens=2)


def test_sigterm_to_the_process_group_stops_serve_fast_and_leaves_nothing(served):
    proc = served["proc"]
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    rest = proc.stdout.read()
    proc.wait()
    took = time.monotonic() - t0
    assert proc.returncode == 0, rest
    # Serve's graceful shutdown would wait 30 s for a controller that can no longer finish (38 s in all): skipped.
    assert "skipping Serve's graceful shutdown" in rest and "specserve: stopped." in rest, rest
    assert took < 25, f"took {took:.1f} s:\n{rest}"
    everything = served["out"] + rest
    assert "graceful_shutdown" not in everything and "Traceback" not in everything, everything
    assert KEY not in everything
    assert_session_empty(proc.pid)
