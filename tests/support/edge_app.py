"""One Serve app for the tests of the HTTP edge (strict input, API keys, fuzzing) and of the demo pair served end to
end: the demo target (a tokenizer and a chat template), the default drafter of `specserve serve` (prompt lookup in the
coordinator, the shipped distilled drafter on a drafter replica), an API key and a short body read timeout.
Deployed once per test session, on first use; it stays up until the session's Serve stops (at the end of its group
of tests, tests/conftest.py)."""

from __future__ import annotations

import glob
import os
from typing import Optional

from tests.support.serve import run_app

APP = "edge"
MODEL = "edge-demo"
KEY = "sk-edge-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_READ_TIMEOUT_S = 2.0
MAX_SEQ_LEN = 1024

_url: Optional[str] = None


def edge_app(demo_path: str) -> str:
    """The app's base URL (deploying it the first time)."""
    global _url
    if _url is None:
        from deployments.app import build_app
        from pipeline.models.store import DEMO_DRAFT, resolve

        config = {
            "served_model_name": MODEL,
            "target": {"model": demo_path, "max_seq_len": MAX_SEQ_LEN, "max_batch_size": 4},
            "drafter": {"draft": "lookup+" + str(resolve(DEMO_DRAFT))},
            "ingress": {"api_keys": [KEY], "body_read_timeout_s": BODY_READ_TIMEOUT_S, "max_body_bytes": 64 * 1024},
        }
        _url = run_app(build_app(config), APP)
    return _url


def forget() -> None:
    """Serve is going away (tests.support.serve.stop_serve): the next edge_app deploys again."""
    global _url
    _url = None


def ingress_log() -> str:
    """What the app's Ingress replicas have logged so far (Serve's replica log files of this Ray session)."""
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    text = []
    for path in sorted(glob.glob(os.path.join(logs, "serve", f"replica_{APP}_Ingress_*.log"))):
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "".join(text)


def app_log() -> str:
    """Every log file of this Ray session (Serve's replica logs, the workers' stdout and stderr), as text."""
    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    text = []
    for path in sorted(glob.glob(os.path.join(logs, "**", "*"), recursive=True)):
        if os.path.isfile(path) and path.endswith((".log", ".out", ".err")):
            with open(path, errors="replace") as f:
                text.append(f.read())
    return "".join(text)
