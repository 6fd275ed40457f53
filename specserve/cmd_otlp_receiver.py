"""`specserve otlp-receiver`: a minimal OTLP trace receiver (HTTP and gRPC) that appends every span it gets to
a JSON-lines file, for looking at specserve's traces where no Jaeger runs (see specserve/otlp_receiver.py).

    specserve otlp-receiver --http-port 4318 --grpc-port 4317 --dump spans.jsonl
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 specserve serve      # in another shell
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=4318)
    p.add_argument("--grpc-port", type=int, default=None, help="also receive OTLP/gRPC on this port")
    p.add_argument("--dump", default="spans.jsonl", help="append every span here as a JSON line")


def run(args: argparse.Namespace) -> int:
    # Imported here: the OpenTelemetry protobufs and gRPC are not needed for `specserve --help`.
    from specserve.otlp_receiver import serve_forever

    serve_forever(args.host, args.http_port, args.grpc_port, args.dump)
    print("specserve otlp-receiver: stopped.", flush=True)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("otlp-receiver", help="receive OTLP traces and append the spans to a file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
