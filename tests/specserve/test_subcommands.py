"""The subcommand table, the prompts shipped in the package, and `specserve otlp-receiver` as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from specserve.cli import build_parser
from specserve.prompts import SPEC_BENCH_DEV, load_prompts


def test_the_cli_lists_every_subcommand():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"generate", "serve", "bench", "bench-serve", "distill", "load", "otlp-receiver",
                                "chaos", "tune-tree"}


def test_bench_has_no_path_loaded_gpu_mode():
    proc = subprocess.run([sys.executable, "-m", "specserve", "bench", "--gpu"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --gpu" in proc.stderr
    help_text = subprocess.run([sys.executable, "-m", "specserve", "bench", "--help"], capture_output=True,
                               text=True, timeout=120).stdout
    assert "python -m ops.gpu_bench" in help_text


def test_the_spec_bench_prompts_ship_in_the_package():
    assert SPEC_BENCH_DEV.is_file() and (SPEC_BENCH_DEV.parent / "SPEC_BENCH_LICENSE").is_file()
    samples = load_prompts(SPEC_BENCH_DEV, per_category=1)
    assert [s.category for s in samples] == sorted(
        {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"})
    assert all(s.prompt for s in samples)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_otlp_receiver_subcommand_receives_and_dumps_spans(tmp_path, stop):
    """Run as a user runs it, and stopped with Ctrl-C or a SIGTERM, also where its parent ignores SIGINT (as a shell
    does for a background job): a clean stop, exit 0."""
    dump = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "otlp-receiver", "--http-port", "0",
                             "--dump", str(dump)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        first = proc.stdout.readline()
        assert first.startswith("OTLP/HTTP on http://127.0.0.1:"), first + proc.stderr.read()
        url = first.split()[2].rstrip(",;")
        request = ExportTraceServiceRequest()
        span = request.resource_spans.add().scope_spans.add().spans.add()
        span.name, span.trace_id, span.span_id = "probe", b"\x01" * 16, b"\x02" * 8
        post = urllib.request.Request(url, data=request.SerializeToString(), method="POST",
                                      headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(post, timeout=10) as response:
            assert response.status == 200
        assert [json.loads(line)["name"] for line in dump.read_text().splitlines()] == ["probe"]
    finally:
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped." in out, out + err
    assert "Traceback" not in err, err
