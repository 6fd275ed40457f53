"""`specserve serve --api-key KEY` end to end: the `openai` client with the key is served, one without it gets 401,
the key is never printed, and Ctrl-C stops the server cleanly: no traceback, and none of Serve's "graceful_shutdown
failed ... infinite retries" line. A real server on the demo target, in its own session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from deployments.ray_env import ray_environment
from tests.specserve.test_serve_signals import _assert_session_empty, _free_port
from tests.support.serve import read_until

pytestmark = pytest.mark.slow

KEY = "sk-cli-test-3f9a1c"


def test_api_key_flag_guards_the_server_and_ctrl_c_stops_it_quietly():
    import openai

    port = _free_port()
    env = dict(ray_environment(), PYTHONUNBUFFERED="1")
    env.pop("SPECSERVE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(port), "--draft",
                             "prompt-lookup", "--api-key", KEY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    watchdog = threading.Timer(400, lambda: os.killpg(proc.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        started = read_until(proc, "Press Ctrl-C")
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="Hello", max_tokens=2)
        assert done.usage.completion_tokens >= 1
        stranger = openai.OpenAI(base_url=base, api_key="not-the-key", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model=model, prompt="Hello", max_tokens=2)

        proc.send_signal(signal.SIGINT)  # Ctrl-C: the driver alone
        rest = proc.stdout.read()
        proc.wait()
    finally:
        watchdog.cancel()
    everything = started + rest
    assert proc.returncode == 0, everything
    assert "specserve: stopped." in rest, rest
    assert "graceful_shutdown" not in everything and "Traceback" not in everything, everything
    assert KEY not in everything
    _assert_session_empty(proc.pid)
