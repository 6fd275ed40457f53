"""Thin OpenTelemetry helpers: one trace per request, across Ray processes and nodes.

Off by default and then free: unless `OTEL_EXPORTER_OTLP_ENDPOINT` is set (or a test installs a provider
with `configure`), `span()` returns one shared no-op object, `inject()` returns an empty dict and
`extract()` returns None, without importing the OpenTelemetry SDK.

When on, every process (ingress, coordinator, drafter and target replicas) lazily builds its own
TracerProvider the first time it opens a span, exporting OTLP to the endpoint (Jaeger all-in-one ingests
OTLP natively: `http://jaeger:4318` for OTLP/HTTP, the default, or `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` with
`http://jaeger:4317`). The standard `OTEL_*` variables apply (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_TRACES_SAMPLER`...).

Context crosses Ray calls as a plain dict argument holding the W3C `traceparent` header:

    # caller (coordinator)
    with tracing.span("draft", k=4) :
        block = await drafter.propose.remote(batch, trace=tracing.inject())
    # callee (drafter replica, another process)
    async def propose(self, batch, trace=None):
        with tracing.span("drafter.propose", parent=trace, replica=self.replica_id):
            ...
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Awaitable, Callable, Mapping

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
DEFAULT_SERVICE_NAME = "specserve"

Carrier = dict[str, str]  # W3C trace-context headers: {"traceparent": "00-<trace>-<span>-01"}

_lock = threading.Lock()
_tracer: Any = None  # opentelemetry.trace.Tracer once configured; None: not decided yet
_enabled: bool | None = None  # None: not decided yet (decided on first use, from the environment)
_provider: Any = None  # the TracerProvider this module made (to flush / shut down)


class _NoopSpan:
    """Stands in for a span (and for its context manager) when tracing is off. Stateless and shared."""

    __slots__ = ()

    def __enter__(self) -> "_NoopSpan":
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def end(self) -> None:
        pass


NOOP_SPAN = _NoopSpan()


def _endpoint_configured() -> bool:
    return bool(os.environ.get(ENDPOINT_ENV) or os.environ.get(TRACES_ENDPOINT_ENV))


def _make_exporter() -> Any:
    """The OTLP span exporter named by OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL (default http/protobuf)."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use 'http/protobuf' or 'grpc'"
        )
    return OTLPSpanExporter()  # reads the endpoint, headers, timeout from the OTEL_* environment


def configure(
    exporter: Any = None,
    *,
    service_name: str | None = None,
    simple: bool = False,
) -> bool:
    """Turn tracing on in this process with `exporter` (default: OTLP from the environment).

    Returns whether tracing is on. With no exporter and no endpoint in the environment, tracing stays off.
    `simple=True` exports each span as it ends (tests); the default batches in a background thread.
    Calling it again replaces the provider (tests use it with an InMemorySpanExporter).
    """
    global _tracer, _enabled, _provider
    with _lock:
        if exporter is None and not _endpoint_configured():
            _tracer, _enabled, _provider = None, False, None
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if exporter is None:
            exporter = _make_exporter()
        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; the pid and Ray identity tell processes apart.
        resource = Resource.create({"service.name": name, "process.pid": os.getpid(), **_ray_identity()})
        provider = TracerProvider(resource=resource)
        processor = SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter)
        provider.add_span_processor(processor)
        if _provider is not None:
            _provider.shutdown()
        # Kept local to this module (not set as the global provider) so that a test can reconfigure it.
        _provider = provider
        _tracer = provider.get_tracer("specserve")
        _enabled = True
        return True


def _ray_identity() -> dict[str, str]:
    """The Ray actor (Serve replica or worker) and node this process is, when it is one."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    out: dict[str, str] = {}
    try:
        ctx = ray.get_runtime_context()
        out["ray.node_id"] = ctx.get_node_id()
        actor_id = ctx.get_actor_id()
        if actor_id:
            out["ray.actor_id"] = actor_id
            out["ray.actor_name"] = ctx.get_actor_name() or ""
    except Exception:  # noqa: BLE001 - identity is a nicety; never fail tracing over it
        pass
    return out


def _get_tracer() -> Any:
    """The tracer, or None when tracing is off. Decides from the environment on first use."""
    if _enabled is None:
        configure()
    return _tracer


def enabled() -> bool:
    return _get_tracer() is not None


def disable() -> None:
    """Turn tracing off in this process (flushing what was recorded)."""
    global _tracer, _enabled, _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _tracer, _enabled, _provider = None, False, None


def force_flush(timeout_millis: int = 5000) -> bool:
    """Export every finished span now (call before a process exits or at the end of a test)."""
    return _provider.force_flush(timeout_millis) if _provider is not None else True


def inject() -> Carrier:
    """The current span's context as W3C headers, to pass as a plain argument over a Ray call.

    Empty when tracing is off or no span is open: `extract({})` gives no parent (a new trace).
    """
    if _get_tracer() is None:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Any:
    """An OpenTelemetry Context from headers made by `inject()` (or an HTTP request's headers)."""
    if not carrier or _get_tracer() is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    # HTTP header names arrive in any case; the propagator looks up "traceparent" exactly.
    lowered = {k.lower(): v for k, v in carrier.items()}
    return TraceContextTextMapPropagator().extract(lowered)


def span(name: str, parent: Mapping[str, str] | None = None, **attrs: Any) -> Any:
    """Open a span (a context manager yielding it) as a child of the current span, or of `parent`.

    `parent` is a carrier from `inject()` in another process; None or {} means the current context.
    Attributes whose value is None are dropped; names without a dot get the `specserve.` prefix
    (`k=4` becomes `specserve.k`), names with one are kept (`db.system="redis"`).
    """
    tracer = _get_tracer()
    if tracer is None:
        return NOOP_SPAN
    context = extract(parent) if parent else None
    return tracer.start_as_current_span(name, context=context, attributes=_attributes(attrs))


def start_span(name: str, parent: Mapping[str, str] | None = None, **attrs: Any) -> Any:
    """Start a span without making it current (for a span that outlives a function, e.g. one that ends
    when a stream ends, or that spans an async generator's yields). End it with `.end()`; pass it on with
    `carrier_of(span)`. NOOP_SPAN when tracing is off."""
    tracer = _get_tracer()
    if tracer is None:
        return NOOP_SPAN
    return tracer.start_span(name, context=extract(parent) if parent else None, attributes=_attributes(attrs))


def carrier_of(target: Any) -> Carrier:
    """W3C headers naming `target` (a span from start_span or span) as the parent: {} when off."""
    if target is NOOP_SPAN or _get_tracer() is None:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(target))
    return carrier


def annotate(**attrs: Any) -> None:
    """Set attributes on the current span (no-op when tracing is off or no span is open)."""
    if _get_tracer() is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(_attributes(attrs))


def traced(name: str, **attrs: Any) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Decorate an async function to run inside `span(name, **attrs)` (e.g. each Redis operation)."""

    def wrap(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def inner(*args: Any, **kwargs: Any) -> Any:
            if _get_tracer() is None:
                return await fn(*args, **kwargs)
            with span(name, **attrs):
                return await fn(*args, **kwargs)

        return inner

    return wrap


def set_attributes(target: Any, **attrs: Any) -> None:
    """Set attributes on a span from `span()` (no-op when tracing is off), with the same naming rule."""
    if target is not NOOP_SPAN:
        target.set_attributes(_attributes(attrs))


def _attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        if value is None:
            continue
        if not isinstance(value, (str, bool, int, float)):
            if isinstance(value, (list, tuple)):
                value = list(value)
            else:
                value = str(value)
        out[key if "." in key else f"specserve.{key}"] = value
    return out
