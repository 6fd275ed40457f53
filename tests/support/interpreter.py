"""Running a cases file under Triton's CPU interpreter, in a child process (see tests/support/decode_attention_cases.py
for why: the interpreter mode is fixed per process when triton is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def run_interpreted(cases_file: str, parts: int = 1) -> dict:
    """`TRITON_INTERPRET=1 python cases_file`; its last stdout line, as JSON. With `parts` > 1, that many children at
    once, each given `--part I/N` (the cases file runs its share of the cases), their results merged: the
    interpreter keeps one core busy, and on the two cores of CI the other is often idle while the other pytest
    worker waits on Ray."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # a checkout not pip-installed
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=path)
    args = [[]] if parts == 1 else [["--part", f"{i}/{parts}"] for i in range(parts)]
    procs = [subprocess.Popen([sys.executable, str(Path(cases_file)), *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for a in args]
    results: dict = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, out[-2000:] + err[-4000:]
            results.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
