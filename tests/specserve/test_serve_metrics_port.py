"""`specserve serve --metrics-port`: a port in use is refused in one line before anything starts."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.support import ROOT


def test_a_metrics_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "specserve", "serve", "--metrics-port", str(port),
                               "--draft", "prompt-lookup"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"specserve serve: error: metrics port {port} is in use: pass --metrics-port "
                                   f"with a free port (0 picks one)")
    assert "starting Ray" not in proc.stdout


def test_a_metrics_port_out_of_range_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "specserve", "serve", "--metrics-port", "70000"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("--metrics-port must be 0-65535, got 70000")
