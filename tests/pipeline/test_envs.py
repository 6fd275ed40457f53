"""pipeline.envs: the one reader of specserve's environment variables (typed, read lazily, bad values named)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import envs
from tests.support import ROOT


def test_variables_are_read_when_asked_for_not_at_import(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECSERVE_CACHE", raising=False)
    assert envs.SPECSERVE_CACHE == Path.home() / ".cache" / "specserve"
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert envs.SPECSERVE_CACHE == tmp_path  # set after import: seen
    monkeypatch.setenv("SPECSERVE_CACHE", "")
    assert envs.SPECSERVE_CACHE == Path.home() / ".cache" / "specserve"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.TRITON_INTERPRET is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert envs.TRITON_INTERPRET is False
    assert set(dir(envs)) == set(envs.environment_variables)
    with pytest.raises(AttributeError, match="SPECSERVE_NOPE"):
        envs.SPECSERVE_NOPE  # noqa: B018


def test_a_bad_value_raises_when_read_naming_the_variable(monkeypatch):
    monkeypatch.setenv("SPECSERVE_REDIS_SERVER", "/no/such/redis-server")
    with pytest.raises(ValueError, match="SPECSERVE_REDIS_SERVER='/no/such/redis-server' names no executable"):
        envs.SPECSERVE_REDIS_SERVER  # noqa: B018
    monkeypatch.setenv("SPECSERVE_REDIS_SERVER", sys.executable)  # any executable file will do here
    assert envs.SPECSERVE_REDIS_SERVER == sys.executable
    monkeypatch.delenv("SPECSERVE_REDIS_SERVER")
    assert envs.SPECSERVE_REDIS_SERVER is None
    # and importing never reads: a bad value does not stop the import
    env = {"SPECSERVE_REDIS_SERVER": "/no/such/redis-server", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import pipeline.envs, deployments.embedded_redis"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_nothing_else_reads_specserve_variables():
    """Only pipeline/envs.py reads SPECSERVE_* variables in the packages (settings are typed config)."""
    read = re.compile(r"(environ|getenv)[^\n]*SPECSERVE_")
    found = [f"{p.relative_to(ROOT)}:{n}" for pkg in ("pipeline", "deployments", "specserve")
             for p in sorted((ROOT / pkg).rglob("*.py")) if p != ROOT / "pipeline" / "envs.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert found == []
