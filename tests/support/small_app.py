"""One Serve app for the admission tests (tests/deployments/test_admission_serve.py) and the step-by-step comparison
with the engine (tests/deployments/test_one_step.py): the tiny llama target with 2 KV-cache slots and a queue of 3,
the hybrid drafter (prompt lookup in the coordinator, the tiny draft model on a drafter replica), a fixed K (the
adaptive policy off, so the engine and Serve take the same K every step). Deployed on first use; the last module
of its group that uses it deletes it (`delete_small_app`), else it goes with the session's Serve (tests/conftest.py)."""

from __future__ import annotations

from typing import Optional

from tests.support.serve import run_app

APP = "small"
MODEL = "tiny-small"
SLOTS, QUEUE = 2, 3
K = 3
RETRY_AFTER_S = 3
MAX_SEQ_LEN = 512  # the admission test's 400-token streams

_url: Optional[str] = None


def small_app(tiny_models: dict) -> str:
    """The app's base URL (deploying it the first time)."""
    global _url
    if _url is None:
        from deployments.app import build_app

        config = {
            "served_model_name": MODEL,
            "target": {"model": str(tiny_models["llama"]), "max_seq_len": MAX_SEQ_LEN, "max_batch_size": SLOTS,
                       "max_waiting": QUEUE},
            "drafter": {"draft": "lookup+" + str(tiny_models["draft"])},
            "coordinator": {"adaptive_k": False, "retry_after_s": RETRY_AFTER_S},
            "speculation": {"num_draft_tokens": K},
        }
        _url = run_app(build_app(config), APP)
    return _url


def delete_small_app() -> None:
    """Take the app down now (its last user is done): its idle replicas would take CPU from the tests after it."""
    global _url
    if _url is not None:
        from ray import serve

        serve.delete(APP)
        _url = None


def forget() -> None:
    """Serve is going away (tests.support.serve.stop_serve): the next small_app deploys again."""
    global _url
    _url = None
