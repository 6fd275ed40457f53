"""A minimal OTLP trace receiver (OTLP/HTTP protobuf, and OTLP/gRPC) that keeps spans in memory.

For tests and for looking at traces where no Jaeger runs:

    specserve otlp-receiver --http-port 4318 --grpc-port 4317 --dump spans.jsonl

Each received span becomes a flat dict (hex ids, parent id, name, attributes, resource attributes,
start/end in ns). It decodes the same protobufs Jaeger's OTLP receiver does, so a trace that reads well
here reads the same in Jaeger.
"""

from __future__ import annotations

import gzip
import json
import signal
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def decode_spans(request: Any) -> list[dict[str, Any]]:
    """Flatten an ExportTraceServiceRequest into one dict per span."""
    out = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append({
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None,
                    "name": s.name,
                    "kind": int(s.kind),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "status_code": int(s.status.code),
                    "attributes": {kv.key: _any_value(kv.value) for kv in s.attributes},
                    "resource": resource,
                })
    return out


class OTLPReceiver:
    """Receives OTLP traces on 127.0.0.1; `spans` grows as exports arrive (thread-safe reads via copy)."""

    def __init__(self, host: str = "127.0.0.1", http_port: int = 0, grpc_port: int | None = None,
                 dump_path: str | None = None):
        self.host = host
        self._http_port = http_port
        self._grpc_port = grpc_port
        self._dump_path = dump_path
        self._spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._grpc: Any = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    # -- receiving --------------------------------------------------------------------------------------
    def _add(self, request: Any) -> None:
        spans = decode_spans(request)
        with self._lock:
            self._spans.extend(spans)
            if self._dump_path:
                with open(self._dump_path, "a") as f:
                    for s in spans:
                        f.write(json.dumps(s) + "\n")

    def start(self) -> "OTLPReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._add(request)
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer((self.host, self._http_port), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True, name="otlp-http").start()

        if self._grpc_port is not None:
            class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC naming)
                    receiver._add(request)
                    return ExportTraceServiceResponse()

            self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
            self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:{self._grpc_port}")
            self._grpc.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reading ----------------------------------------------------------------------------------------
    @property
    def http_endpoint(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def spans(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Poll until predicate(spans) is true; return the spans (raise TimeoutError with what arrived)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s["name"] for s in spans})
                raise TimeoutError(f"{len(spans)} spans arrived, names {names}; predicate still false")
            time.sleep(0.1)


def serve_forever(host: str, http_port: int, grpc_port: int | None, dump: str) -> int:
    """Receive spans until Ctrl-C or SIGTERM, appending each to `dump` as a JSON line; -> the signal that stopped
    it. Both signals get a handler of their own: a process started where SIGINT is ignored (a shell's background
    job, a parent that ignores it) stops on Ctrl-C all the same."""
    stopped: list[int] = []
    done = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stopped.append(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    receiver = OTLPReceiver(host, http_port, grpc_port, dump).start()
    print(f"OTLP/HTTP on {receiver.http_endpoint}/v1/traces"
          + (f", OTLP/gRPC on {host}:{receiver.grpc_port}" if receiver.grpc_port else "")
          + f"; spans appended to {dump}", flush=True)
    try:
        while not done.wait(1.0):  # a timed wait: the handler runs between waits
            pass
    finally:
        receiver.stop()
    return stopped[0]
