"""`specserve serve` stopped the way process managers stop it: a SIGTERM to its whole process group (`timeout`,
a systemd stop), which reaches Ray's own daemons too. A real server on the demo models, in its own session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return [int(pid) for pid, s in (line.split() for line in out.splitlines() if line.strip()) if int(s) == sid]


def test_sigterm_to_the_process_group_stops_serve_fast_and_leaves_nothing():
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(_free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    watchdog = threading.Timer(400, lambda: os.killpg(proc.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "Press Ctrl-C" in line:
                break
        assert "Press Ctrl-C" in "".join(seen), "".join(seen)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rest = proc.stdout.read()
        proc.wait()
        took = time.monotonic() - t0
    finally:
        watchdog.cancel()
    assert proc.returncode == 0, rest
    # Before: Serve's graceful shutdown waited 30 s for a controller that could no longer finish (38 s in all).
    assert "skipping Serve's graceful shutdown" in rest and "specserve: stopped." in rest, rest
    assert took < 25, f"took {took:.1f} s:\n{rest}"
    deadline = time.monotonic() + 15
    while _session_pids(proc.pid) and time.monotonic() < deadline:  # Ray's daemons, actors, embedded Redis
        time.sleep(0.2)
    assert not _session_pids(proc.pid), subprocess.run(["ps", "-o", "pid,sid,comm", "-s", str(proc.pid)],
                                                       capture_output=True, text=True).stdout
