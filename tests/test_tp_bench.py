"""The GPU tensor-parallel benchmark script runs end to end on CPU (tiny shape, gloo, spawned ranks), so the
script a GPU session runs in one command is not first exercised there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_tp_bench_smoke_on_cpu(tmp_path):
    cmd = [sys.executable, "ops/tp_bench.py", "--device", "cpu", "--shapes", "tiny", "--sizes", "1,2",
           "--context", "24", "--iters", "3", "--control", "socket,gloo", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "1", "2", "2"], out.stdout  # TP, for T = 1 and 5
    assert "driven (socket)" in out.stdout and "driven (gloo)" in out.stdout
    import json

    rows = json.loads((tmp_path / "tp_bench_tiny_tp2.json").read_text())["rows"]
    assert all(r["driven_socket_ms"] > 0 and r["driven_gloo_ms"] > 0 for r in rows)  # both channels drove steps
    assert all(r["synced_ms"] > 0 for r in rows)
    sys.path.insert(0, str(ROOT / "ops"))
    import tp_bench

    tp1, tp2 = (tp_bench.logits_diff(tmp_path, "tiny", n, "fp32") for n in (1, 2))
    assert tp1["argmax_agree"] == 1.0 and tp2["argmax_agree"] == 1.0
    assert tp2["rel_to_max_logit"] < 0.05  # bf16 TP=2 vs the fp32 model: bf16-sized error
    assert set(torch.load(tmp_path / "logits_tiny_tp2.pt")) == {"T1", "T5"}
