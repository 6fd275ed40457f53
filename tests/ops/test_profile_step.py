"""The step profiler (ops/profile_step.py) runs end to end on CPU, so the script a GPU session runs is not first
exercised there, and its phase accounting adds up."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_profile_step_on_cpu(tmp_path):
    cmd = [sys.executable, "ops/profile_step.py", "--device", "cpu", "--batch", "2", "--ks", "0,2",
           "--prompt-len", "40", "--warmup", "1", "--steps", "3", "--iters", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "profile_step_smollm2-135m_b2.json").read_text())
    off, spec = result["rows"]
    assert (off["k"], spec["k"]) == (0, 2)
    assert off["propose_ms"] == 0 and off["mean_T"] == 1 and off["tokens_per_step_per_row"] == 1
    # The prompts repeat one chunk, so prompt lookup drafts every step and the target verifies K + 1 tokens.
    assert spec["propose_ms"] > 0 and spec["mean_T"] == 3 and spec["tokens_per_step_per_row"] >= 1
    for row in (off, spec):
        phases = [row[f"{p}_ms"] for p in ("sampling", "propose", "target", "verify", "accept")]
        assert min(phases) >= 0 and row["rest_ms"] >= 0 and row["target_ms"] > 0
        assert abs(sum(phases) + row["rest_ms"] - row["step_ms"]) < 1e-6
    assert "| 2 | 3.00 |" in out.stdout
