"""Running a cases file under Triton's CPU interpreter, in a child process (see tests/support/decode_attention_cases.py
for why: the interpreter mode is fixed per process when triton is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def run_interpreted(cases_file: str) -> dict:
    """`TRITON_INTERPRET=1 python cases_file`; its last stdout line, as JSON."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # a checkout not pip-installed
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(Path(cases_file))], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
