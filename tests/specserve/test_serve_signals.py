"""`specserve serve` stopped by a SIGTERM to its whole process group (`timeout`, a systemd stop) while it is still
starting. A real server on the demo models, in its own session. (The same signal to a running server:
tests/specserve/test_served.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from deployments.ray_env import ray_environment
from tests.support.serve import read_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(pid) for pid, s in (line.split() for line in out.splitlines() if line.strip()) if int(s) == sid]


def _serve_in_own_session() -> subprocess.Popen:
    env = dict(ray_environment(), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(_free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _signal_group_after(proc: subprocess.Popen, marker: str, delay_s: float) -> tuple[str, float]:
    """Read the server's output up to the line with `marker`, wait `delay_s`, send SIGTERM to its whole process
    group; return (what it printed after that, seconds to exit)."""
    watchdog = threading.Timer(400, lambda: os.killpg(proc.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        read_until(proc, marker)
        time.sleep(delay_s)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read()
        proc.wait()
        return rest, time.monotonic() - t0
    finally:
        watchdog.cancel()


def assert_session_empty(sid: int, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while _session_pids(sid) and time.monotonic() < deadline:  # Ray's daemons, actors, embedded Redis
        time.sleep(0.2)
    assert not _session_pids(sid), subprocess.run(["ps", "-o", "pid,sid,comm", "-s", str(sid)],
                                                  capture_output=True, text=True).stdout


def test_sigterm_during_start_up_stops_serve_without_a_crash():
    """A SIGTERM while Serve starts (Ray's own handler would dump a stack and abort the driver): interrupted like
    Ctrl-C, shut down, nothing left."""
    proc = _serve_in_own_session()
    rest, _ = _signal_group_after(proc, "Ray is up; deploying", 2.0)  # Serve is starting its replicas
    assert proc.returncode == 130 and "interrupted" in rest, (proc.returncode, rest)
    assert "SIGTERM received" not in rest and "Traceback" not in rest, rest
    # Workers the raylet was launching as the signal came miss it; they leave by themselves once they find the
    # raylet gone (about 20 s here).
    assert_session_empty(proc.pid, within_s=60)
