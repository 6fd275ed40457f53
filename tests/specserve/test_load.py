"""specserve load against a fake OpenAI-compatible streaming server on 127.0.0.1 (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request  # Request at module level: FastAPI resolves the annotation here
from fastapi.responses import JSONResponse, StreamingResponse

from specserve import loadgen
from specserve.prompts import SPEC_BENCH_DEV
from tests.support import ROOT

ROOT = str(ROOT)
CHUNK_GAP_S = 0.02
CHUNKS = ("Hel", "lo wor", "ld", "!")  # 4 content chunks, 10 tokens in all (usage says so)


class FakeServer:
    """Streams 4 chunks per request; fails (HTTP 500) every request whose seed is a multiple of 5."""

    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0
        self.bodies: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            if body["seed"] % 5 == 0:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)

            async def events():
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                try:
                    first = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                    yield f"data: {json.dumps(first)}\n\n"
                    for i, text in enumerate(CHUNKS):
                        await asyncio.sleep(CHUNK_GAP_S)
                        finish = "length" if i == len(CHUNKS) - 1 else None
                        ev = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
                        yield f"data: {json.dumps(ev)}\n\n"
                    tail = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 10,
                                                     "total_tokens": 15},
                            "speculation": {"drafted": 12, "accepted": 6, "target_passes": 4,
                                            "acceptance_by_position": [0.75, 0.5, 0.25],
                                            "queue_wait_s": 0.25, "target_replays": 1}}
                    yield f"data: {json.dumps(tail)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.active -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            assert time.time() < deadline, "fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server():
    with FakeServer() as s:
        yield s


def test_load_summary_counts_latencies_and_speculation(server, tmp_path):
    server.max_active = 0
    config = loadgen.LoadConfig(url=server.url, concurrency=3, num_requests=10, max_tokens=10,
                             num_draft_tokens=3)
    summary = loadgen.run(config, ["a prompt", "another prompt"], tmp_path, progress=False)
    assert summary["model"] == "fake-model"
    assert summary["requests"]["sent"] == 10
    assert summary["requests"]["ok"] == 8  # seeds 0 and 5 fail
    assert summary["requests"]["failed"] == 2
    (err,) = summary["requests"]["errors"]
    assert err.startswith("HTTP 500") and summary["requests"]["errors"][err] == 2
    assert server.max_active == 3  # the clients really overlapped, and never more than asked
    assert summary["throughput"]["completion_tokens"] == 80
    assert summary["tokens_per_chunk"] == pytest.approx(10 / 4)
    ttft, itl = summary["ttft_s"], summary["itl_s"]
    assert ttft["count"] == 8 and ttft["p50"] >= CHUNK_GAP_S * 0.9
    assert itl["count"] == 8 * 3 and CHUNK_GAP_S * 0.9 <= itl["p50"] < 10 * CHUNK_GAP_S
    assert summary["tpot_s"]["count"] == 8
    assert summary["queue_wait_s"]["count"] == 8 and summary["queue_wait_s"]["p99"] == pytest.approx(0.25)
    assert summary["target_replays"] == 8 and summary["requests"]["rejected"] == 0
    spec = summary["speculation"]
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["mean_accepted_tokens"] == pytest.approx((6 + 4) / 4)
    assert spec["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.25])
    body = server.bodies[-1]
    assert body["stream"] and body["speculation"] == {"num_draft_tokens": 3} and body["max_tokens"] == 10

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["requests"] == summary["requests"]
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(10))
    for name in ("ttft.png", "itl.png", "queue_wait.png", "latency.png", "tokens_per_s.png", "acceptance.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_refusals_are_counted_apart_and_missing_stats_stay_unknown():
    config = loadgen.LoadConfig()
    refused = loadgen.RequestRecord(index=0, client=0, prompt_chars=1, start=0.0, status=429,
                                    error='HTTP 429: {"error": ...}')
    plain = loadgen.RequestRecord(index=1, client=0, prompt_chars=1, start=0.0, ok=True, status=200, ttft_s=0.1,
                                  e2e_s=0.2, completion_tokens=3, speculation={})
    summary = loadgen.summarize([refused, plain], 1.0, config, "m")
    assert summary["requests"]["rejected"] == 1 and summary["requests"]["failed"] == 1
    assert summary["queue_wait_s"] is None and summary["target_replays"] is None  # not reported: not zero


def test_duration_bounds_the_run(server):
    config = loadgen.LoadConfig(url=server.url, concurrency=2, num_requests=10_000, duration_s=0.5)
    t = time.perf_counter()
    summary = loadgen.run(config, ["p"], None, progress=False)
    assert time.perf_counter() - t < 3.0
    assert 2 <= summary["requests"]["sent"] < 100


def test_a_stop_event_ends_the_run_and_lets_requests_in_flight_finish(server):
    stop = threading.Event()
    config = loadgen.LoadConfig(url=server.url, concurrency=2, num_requests=10_000, duration_s=60)
    threading.Timer(0.5, stop.set).start()
    summary = loadgen.run(config, ["p"], None, progress=False, stop=stop)
    assert 2 <= summary["requests"]["sent"] < 200  # 60 s would send over a thousand
    assert all(err.startswith("HTTP 500") for err in summary["requests"]["errors"])  # the fake's; none cut off


def test_unreachable_server_is_an_error_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here after the close
    config = loadgen.LoadConfig(url=f"http://127.0.0.1:{port}", model="m", concurrency=2, num_requests=4)
    summary = loadgen.run(config, ["p"], None, progress=False)
    assert summary["requests"]["failed"] == 4
    assert "ConnectError" in next(iter(summary["requests"]["errors"]))


def test_prompts_from_spec_bench_jsonl_and_text(tmp_path):
    prompts = loadgen.load_prompts(SPEC_BENCH_DEV)  # shipped in the package
    assert len(prompts) == 240 and all(isinstance(p, str) and p for p in prompts)
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert loadgen.load_prompts(txt) == ["one", "two"]
    with pytest.raises(ValueError, match="concurrency"):
        loadgen.LoadConfig(concurrency=0)


def test_cli_writes_outputs_and_prints_the_summary(server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "specserve.cmd_load", "--url", server.url, "-c", "2", "-n", "4",
         "--seed", "1", "-o", str(tmp_path), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["requests"]["ok"] == 4  # seeds 1..4
    assert (tmp_path / "acceptance.png").exists()
