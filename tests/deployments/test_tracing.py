"""deployments.tracing: off costs nothing; spans nest; context crosses a process boundary as a dict;
OTLP export over HTTP and gRPC reaches a real receiver (specserve.otlp_receiver decodes the protobufs)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deployments import tracing
from specserve.otlp_receiver import OTLPReceiver
from tests.support import ROOT

ROOT = str(ROOT)


@pytest.fixture
def memory_exporter():
    exporter = InMemorySpanExporter()
    assert tracing.configure(exporter, service_name="test", simple=True)
    yield exporter
    tracing.disable()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def test_off_by_default_is_a_shared_noop_and_never_imports_the_sdk():
    code = textwrap.dedent("""
        import sys
        from deployments import tracing
        s = tracing.span("x", k=4)
        assert s is tracing.NOOP_SPAN, s
        with s as inner:
            inner.set_attribute("a", 1)
        assert tracing.inject() == {}
        assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
        assert not tracing.enabled()
        for _ in range(1000):
            with tracing.span("step", k=4, accepted=3) as step:
                assert step is tracing.NOOP_SPAN
            tracing.inject()
        leaked = [m for m in sys.modules if m.startswith("opentelemetry")]
        assert not leaked, leaked
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_spans_nest_and_attributes_are_prefixed(memory_exporter):
    with tracing.span("request", request_id="r1") as root:
        with tracing.span("step", k=4, accepted=3, skipped=None, **{"db.system": "redis"}) as step:
            tracing.set_attributes(step, step_latency_ms=1.5, replicas=("a", "b"))
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    assert set(spans) == {"request", "step"}
    assert spans["step"].parent.span_id == spans["request"].context.span_id
    assert spans["step"].context.trace_id == root.get_span_context().trace_id
    attrs = dict(spans["step"].attributes)
    assert attrs == {"specserve.k": 4, "specserve.accepted": 3, "db.system": "redis",
                     "specserve.step_latency_ms": 1.5, "specserve.replicas": ("a", "b")}
    assert spans["request"].resource.attributes["service.name"] == "test"


def test_context_crosses_a_boundary_as_a_plain_dict(memory_exporter):
    """A thread starts with an empty context, as a Ray worker does: only the carrier links the spans."""
    with tracing.span("coordinator.step") as parent:
        carrier = tracing.inject()
    assert set(carrier) == {"traceparent"}
    assert isinstance(carrier["traceparent"], str)

    def remote_call(trace):
        with tracing.span("drafter.propose", parent=trace, replica="d0"):
            pass
        with tracing.span("orphan"):  # no carrier: a new trace
            pass

    t = threading.Thread(target=remote_call, args=(dict(carrier),))
    t.start()
    t.join()
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    child = spans["drafter.propose"]
    assert child.context.trace_id == parent.get_span_context().trace_id
    assert child.parent.span_id == parent.get_span_context().span_id
    assert child.parent.is_remote
    assert spans["orphan"].parent is None
    # HTTP headers come in any case.
    ctx = tracing.extract({"TraceParent": carrier["traceparent"]})
    assert trace.get_current_span(ctx).get_span_context().trace_id == parent.get_span_context().trace_id


def test_exception_marks_the_span_as_error(memory_exporter):
    with pytest.raises(RuntimeError):
        with tracing.span("verify"):
            raise RuntimeError("cache miss")
    (s,) = memory_exporter.get_finished_spans()
    assert s.status.status_code.name == "ERROR"
    assert s.events[0].name == "exception"


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_export_from_the_environment_reaches_a_real_receiver(protocol):
    """A separate process configured only by OTEL_* variables exports to the receiver."""
    with OTLPReceiver(grpc_port=0) as receiver:
        endpoint = (receiver.http_endpoint if protocol == "http/protobuf"
                    else f"http://127.0.0.1:{receiver.grpc_port}")
        env = {**_clean_env(), "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
               "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_SERVICE_NAME": "proc-a"}
        code = textwrap.dedent("""
            from deployments import tracing
            with tracing.span("request", k=4):
                with tracing.span("redis.get", **{"db.system": "redis"}):
                    pass
            tracing.force_flush()
        """)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        spans = receiver.wait_for(lambda s: len(s) >= 2, timeout=10)
    by_name = {s["name"]: s for s in spans}
    assert by_name["redis.get"]["parent_span_id"] == by_name["request"]["span_id"]
    assert by_name["redis.get"]["trace_id"] == by_name["request"]["trace_id"]
    assert by_name["request"]["attributes"] == {"specserve.k": 4}
    assert by_name["request"]["resource"]["service.name"] == "proc-a"


def test_start_span_outlives_its_caller_and_parents_remote_work(memory_exporter):
    root = tracing.start_span("POST /v1/completions", request_id="r9")
    carrier = tracing.carrier_of(root)

    def remote_call(trace):
        with tracing.span("coordinator.step", parent=trace):
            tracing.annotate(accepted=2, target="t0")

    t = threading.Thread(target=remote_call, args=(carrier,))
    t.start()
    t.join()
    root.end()
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    step = spans["coordinator.step"]
    assert step.parent.span_id == spans["POST /v1/completions"].context.span_id
    assert dict(step.attributes) == {"specserve.accepted": 2, "specserve.target": "t0"}


def test_traced_decorator_wraps_async_calls(memory_exporter):
    @tracing.traced("redis.commit", **{"db.system": "redis"})
    async def commit(x):
        return x + 1

    async def main():
        with tracing.span("step"):
            return await commit(1)

    assert asyncio.run(main()) == 2
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    assert spans["redis.commit"].parent.span_id == spans["step"].context.span_id
    assert spans["redis.commit"].attributes["db.system"] == "redis"


def test_off_start_span_and_helpers_are_noops():
    tracing.disable()
    s = tracing.start_span("x")
    assert s is tracing.NOOP_SPAN and tracing.carrier_of(s) == {}
    s.end()
    tracing.annotate(a=1)
