"""The GPU tensor-parallel benchmark script runs end to end on CPU (tiny shape, gloo, spawned ranks), so the
script a GPU session runs in one command is not first exercised there."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.support import ROOT


def test_tp_bench_smoke_on_cpu(tmp_path):
    cmd = [sys.executable, "ops/tp_bench.py", "--device", "cpu", "--shapes", "tiny", "--sizes", "1,2",
           "--context", "24", "--iters", "3", "--control", "socket,gloo", "--batches", "1,2", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1"] * 4 + ["2"] * 4, out.stdout  # TP, for B = 1, 2 x T = 1, 5
    assert "driven (socket)" in out.stdout and "driven (gloo)" in out.stdout
    import json

    rows = [r for r in json.loads((tmp_path / "tp_bench_tiny_tp2.json").read_text())["rows"] if r["B"] == 1]
    assert all(r["driven_socket_ms"] > 0 and r["driven_gloo_ms"] > 0 for r in rows)  # both channels drove steps
    assert all(r["synced_ms"] > 0 for r in rows)
    sys.path.insert(0, str(ROOT / "ops"))
    import tp_bench

    tp1, tp2 = (tp_bench.logits_diff(tmp_path, "tiny", n, "fp32") for n in (1, 2))
    assert tp1["argmax_agree"] == 1.0 and tp2["argmax_agree"] == 1.0
    assert tp2["rel_to_max_logit"] < 0.05  # bf16 TP=2 vs the fp32 model: bf16-sized error
    got = torch.load(tmp_path / "logits_tiny_tp2.pt")
    assert set(got) == {"T1", "T5", "B2T1", "B2T5"} and got["B2T5"].shape[:2] == (2, 5)
    assert (got["B2T1"][:1] - got["T1"]).abs().max() < 0.05 * got["T1"].abs().max()  # row 0 alone or in a batch


def _trace(kernels: list[tuple[str, int, float, float]]) -> dict:
    """A Chrome trace as torch.profiler exports it: kernel events (name, programs, start, duration) and others."""
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0}]
    events += [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "args": {"grid": [g, 1, 1], "block": [128, 1, 1]}}
               for n, g, ts, d in kernels]
    return {"traceEvents": events}


def test_step_timeline_charges_each_kernel_its_exposed_time_by_place_in_the_layer():
    sys.path.insert(0, str(ROOT))
    from ops import step_timeline as st

    def step(t0: float) -> list[tuple[str, int, float, float]]:
        ks = [("embed_kernel", 4, t0, 2.0)]
        t = t0 + 2.0
        for _ in range(3):  # 3 layers: a linear, another launch of the same kernel and grid, then a reduce
            ks += [("void fused_linear_kernel<int>(float*)", 256, t, 10.0),  # starts at the previous end
                   ("void fused_linear_kernel<int>(float*)", 256, t + 8.0, 6.0),  # PDL: overlaps by 2 us
                   ("reduce_partials_kernel", 64, t + 13.0, 0.5)]  # ends inside the one before: 0 exposed
            t += 14.0
        return ks + [("logits", 8, t + 1.0, 3.0)]  # a 1 us gap before it: exposed 4

    trace = _trace(step(0.0) + step(100.0))
    kernels = st.kernels_of_trace(trace)
    assert len(kernels) == 2 * 11 and kernels[1].key == "fused_linear_kernel [256]"
    steps = st.split_steps(kernels, 2)
    assert sum(st.exposed_us(steps[0])) == steps[0][-1].end_us - steps[0][0].start_us == 2 + 3 * 14 + 4
    rows = {r["place"]: r for r in st.summarize(steps, n_layers=3)}
    assert set(rows) == {"pre 0", "layer 0", "layer 1", "layer 2", "post 0", "step"}
    assert rows["layer 0"]["exposed_per_layer_us"] == 10.0 and rows["layer 1"]["exposed_per_layer_us"] == 4.0
    assert rows["layer 2"]["exposed_us"] == 0.0 and rows["layer 2"]["busy_us"] == 1.5
    assert rows["layer 1"]["launches"] == 3 and rows["post 0"]["exposed_us"] == 4.0
    assert rows["step"]["exposed_us"] == 48.0 and "3 layers of 3" in rows["step"]["kernel"]
    assert "| layer 1 | fused_linear_kernel [256] | 3 |" in st.format_table(list(rows.values()))
    # a layer count the kernels do not repeat: no layer places, every kernel charged as "pre"
    assert not any(p.startswith("layer") for p in (r["place"] for r in st.summarize(steps, n_layers=4)))
    with pytest.raises(ValueError, match="equal steps"):
        st.split_steps(kernels[:-1], 2)
