"""What a default `specserve serve` opens to the network: every listening socket of its processes (the driver, Ray's
daemons and workers, the embedded Redis) is on loopback, except the ones the README's "What listens where" names with
their protection. Ray's own endpoints answer only to the cluster's token, and the embedded Redis only to its
password. A real server on the demo models, in its own session."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import psutil
import pytest
import redis

from deployments.ray_env import LOCAL_RAY_DEFAULTS, ray_environment

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
WILDCARD = {"0.0.0.0", "::"}


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
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    watchdog = threading.Timer(400, lambda: os.killpg(proc.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "Press Ctrl-C" in line:
                break
        assert "Press Ctrl-C" in "".join(seen), "".join(seen)
        yield {"pid": proc.pid, "port": port, "out": "".join(seen)}
    finally:
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
