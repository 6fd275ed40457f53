"""Prometheus metrics of speculative serving, and the small `record_*` functions the Serve layer calls.

Backend, chosen per process when the first metric is touched:
- inside Ray (a Serve replica, an actor, a driver after `ray.init`): `ray.serve.metrics`, exported at
  `/metrics` by every node's metrics agent on its metrics export port (`ray start --metrics-export-port=8080`
  on a cluster; `specserve serve --metrics-port`, default 8080, on one machine), scraped by Prometheus through
  Ray's service discovery file or a static target. Ray prefixes every name with `ray_` and, inside a replica,
  adds the `deployment`, `replica` and `application` labels. Queue depth and replica counts of Serve itself
  come from Ray's own `ray_serve_*` metrics (the Grafana dashboard in ops/ uses both).
- outside Ray: `prometheus_client`, in its default registry (or one given to `use_registry`, for tests),
  under the same names without the `ray_` prefix.

Cost: the record functions only add to dicts under one lock (a few microseconds per step); a daemon
thread pushes the sums and observations to the backend every FLUSH_INTERVAL_S (`flush()` does it now).
Gauges are set directly, and the flush thread sets each one's last value again every FLUSH_INTERVAL_S: Ray's
metrics agent drops a gauge series that no process has reported for a while, so a value that holds still (16
slots in use for minutes) would otherwise vanish from the scrape.

Vocabulary (docs/architecture.md): per step a row proposes `num_draft` tokens, a prefix of `num_accepted`
is accepted and one recovered or bonus token follows, so `emitted = num_accepted + 1`.
    acceptance rate        = accepted_tokens_total / draft_tokens_total
    mean accepted tokens   = emitted_tokens_total / steps_total   (tokens per target pass, Spec-Bench's "tau")
    acceptance by position = draft_position_accepted_total{position=i} / draft_position_proposed_total{...}
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

# Seconds. From 0.5 ms (one compiled target pass on an H200 is ~6 ms, a Ray call ~1 ms) up to 60 s (TTFT).
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0)
MAX_POSITION_LABEL = 32  # draft positions beyond this share one label, keeping label cardinality bounded


@dataclass(frozen=True)
class _Def:
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tag_keys: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


# The metric catalogue. Names are what prometheus_client shows; Ray's export adds the `ray_` prefix.
DEFS: dict[str, _Def] = {
    "specserve_requests_total": _Def("counter", "Finished requests, by outcome.", ("status",)),
    "specserve_prompt_tokens_total": _Def("counter", "Prompt tokens of finished requests."),
    "specserve_generated_tokens_total": _Def("counter", "Tokens streamed to clients (rate() = tokens/s)."),
    "specserve_steps_total": _Def("counter", "Target passes (steps), counted per request row."),
    "specserve_draft_tokens_total": _Def("counter", "Draft tokens proposed to the target."),
    "specserve_accepted_tokens_total": _Def("counter", "Draft tokens accepted by the target."),
    "specserve_emitted_tokens_total": _Def("counter", "Tokens committed by steps: accepted + recovered/bonus."),
    "specserve_draft_position_proposed_total": _Def(
        "counter", "Draft tokens proposed at each draft position (0-based).", ("position",)),
    "specserve_draft_position_accepted_total": _Def(
        "counter", "Draft tokens accepted at each draft position (0-based).", ("position",)),
    "specserve_steps_by_accepted_total": _Def(
        "counter", "Steps (per request row) by how many draft tokens were accepted: the distribution of "
        "accepted tokens per step, as counters (cheaper than a histogram on the hot path).", ("accepted",)),
    "specserve_prespec_steps_total": _Def(
        "counter", "Steps verified while the drafter pre-speculated the next one, by accepted draft tokens.",
        ("accepted",)),
    "specserve_prespec_hits_total": _Def(
        "counter", "Of those, steps whose outcome matched a pre-speculated branch (its draft was ready), by accepted "
        "draft tokens: hit rate = hits / steps.", ("accepted",)),
    "specserve_step_latency_seconds": _Def(
        "histogram", "One speculation step of a batch (draft + verify + accept), at the coordinator.", (),
        LATENCY_BUCKETS),
    "specserve_draft_latency_seconds": _Def(
        "histogram", "Drafting K tokens: 'call' is the round trip seen by the caller, 'compute' the "
        "drafter replica's own time.", ("scope",), LATENCY_BUCKETS),
    "specserve_verify_latency_seconds": _Def(
        "histogram", "Verifying a draft on the target: 'call' is the round trip seen by the caller, "
        "'compute' the target replica's own time.", ("scope",), LATENCY_BUCKETS),
    "specserve_ttft_seconds": _Def("histogram", "Time to first token.", (), LATENCY_BUCKETS),
    "specserve_inter_token_latency_seconds": _Def(
        "histogram", "Gap between consecutive streamed chunks of a request.", (), LATENCY_BUCKETS),
    "specserve_time_per_output_token_seconds": _Def(
        "histogram", "Per request: (end - first token) / (tokens - 1).", (), LATENCY_BUCKETS),
    "specserve_request_latency_seconds": _Def("histogram", "End-to-end request latency.", (),
                                              LATENCY_BUCKETS),
    "specserve_queue_depth": _Def(
        "gauge", "Calls waiting in a worker for the next batched pass, by stage (target / drafter).",
        ("stage",)),
    "specserve_active_requests": _Def("gauge", "Requests being decoded (holding a batch slot)."),
    "specserve_admission_queue_length": _Def(
        "gauge", "Requests waiting in a worker's queue for a KV-cache slot, by stage (target / drafter).",
        ("stage",)),
    "specserve_admission_wait_seconds": _Def(
        "histogram", "How long a request waited for a KV-cache slot (0 when one was free), by stage.", ("stage",),
        LATENCY_BUCKETS + (120.0, 300.0)),
    "specserve_admission_rejections_total": _Def(
        "counter", "Requests refused a place in the slot queue, by stage ('target': one replica's queue was full; "
        "'request': every replica's was, the client got HTTP 429).", ("stage",)),
    "specserve_preemptions_total": _Def(
        "counter", "Requests whose KV-cache slot was taken back under memory pressure, by stage.", ("stage",)),
}

_lock = threading.Lock()
_metrics: dict[str, Any] = {}
_registry: Any = None  # prometheus_client registry in use; None: the default one
_prometheus_made: dict[tuple[Any, str], Any] = {}  # (registry, name) -> the prometheus_client metric


def _in_ray() -> bool:
    ray = sys.modules.get("ray")  # never import Ray just to find out
    return ray is not None and ray.is_initialized()


def use_registry(registry: Any) -> None:
    """Use prometheus_client with this registry from now on (tests); forgets existing metric objects and
    anything buffered."""
    global _registry
    with _lock:
        _registry = registry
        _metrics.clear()
    with _buffer_lock:
        _counts.clear()
        _observations.clear()
        _gauges.clear()


def reset() -> None:
    """Forget the metric objects (the next record re-creates them with the backend chosen then)."""
    with _lock:
        _metrics.clear()


class _Adapter:
    """One interface over a Ray or prometheus_client metric: inc / observe / set with a tags dict."""

    __slots__ = ("_m", "_ray", "_labelled")

    def __init__(self, metric: Any, ray_backend: bool, labelled: bool):
        self._m, self._ray, self._labelled = metric, ray_backend, labelled

    def _target(self, tags: dict[str, str] | None) -> Any:
        return self._m.labels(**tags) if self._labelled else self._m

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value == 0:
            return  # Ray rejects zero increments; prometheus would record nothing anyway
        if self._ray:
            self._m.inc(value, tags=tags)
        else:
            self._target(tags).inc(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        if self._ray:
            self._m.observe(value, tags=tags)
        else:
            self._target(tags).observe(value)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        if self._ray:
            self._m.set(value, tags=tags)
        else:
            self._target(tags).set(value)


def _create(name: str) -> _Adapter:
    d = DEFS[name]
    if _registry is None and _in_ray():  # a registry given with use_registry means prometheus_client, in Ray too
        from ray.serve import metrics as ray_metrics

        if d.kind == "counter":
            metric = ray_metrics.Counter(name, d.description, tag_keys=d.tag_keys)
        elif d.kind == "gauge":
            metric = ray_metrics.Gauge(name, d.description, tag_keys=d.tag_keys)
        else:
            metric = ray_metrics.Histogram(name, d.description, boundaries=list(d.buckets),
                                           tag_keys=d.tag_keys)
        return _Adapter(metric, True, bool(d.tag_keys))
    import prometheus_client

    key = (_registry, name)  # a registry refuses a second metric of one name: reuse it after a reset()
    if key in _prometheus_made:
        return _Adapter(_prometheus_made[key], False, bool(d.tag_keys))
    kwargs: dict[str, Any] = {"labelnames": d.tag_keys}
    if _registry is not None:
        kwargs["registry"] = _registry
    if d.kind == "counter":
        # prometheus_client appends _total itself.
        metric = prometheus_client.Counter(name.removesuffix("_total"), d.description, **kwargs)
    elif d.kind == "gauge":
        metric = prometheus_client.Gauge(name, d.description, **kwargs)
    else:
        metric = prometheus_client.Histogram(name, d.description, buckets=d.buckets, **kwargs)
    _prometheus_made[key] = metric
    return _Adapter(metric, False, bool(d.tag_keys))


def get(name: str) -> _Adapter:
    m = _metrics.get(name)
    if m is None:
        with _lock:
            m = _metrics.get(name)
            if m is None:
                m = _metrics[name] = _create(name)
    return m


# -- buffering: the hot path only adds to dicts; a daemon thread pushes to the backend every second ------

FLUSH_INTERVAL_S = 1.0  # Ray's agents export every few seconds anyway; Prometheus scrapes every 5-15 s
_counts: dict[tuple[str, str | None], float] = {}  # (metric, tag value) -> increment since the last flush
_observations: dict[tuple[str, str | None], list[float]] = {}
_gauges: dict[tuple[str, str | None], float] = {}  # (metric, tag value) -> last value set
_buffer_lock = threading.Lock()
_flusher: threading.Thread | None = None


def _inc(name: str, value: float, tag: str | None = None) -> None:
    key = (name, tag)
    with _buffer_lock:
        _counts[key] = _counts.get(key, 0.0) + value
    if _flusher is None:
        _start_flusher()


def _observe(name: str, value: float, tag: str | None = None) -> None:
    key = (name, tag)
    with _buffer_lock:
        bucket = _observations.get(key)
        if bucket is None:
            _observations[key] = [value]
        else:
            bucket.append(value)
    if _flusher is None:
        _start_flusher()


def _set(name: str, value: float, tag: str | None = None) -> None:
    with _buffer_lock:
        _gauges[(name, tag)] = value
    get(name).set(value, tags=_tags(name, tag))
    if _flusher is None:
        _start_flusher()


def _tags(name: str, tag: str | None) -> dict[str, str] | None:
    return None if tag is None else {DEFS[name].tag_keys[0]: tag}


def flush() -> None:
    """Push buffered increments and observations to the backend now (tests; the thread does it every
    FLUSH_INTERVAL_S, and once more at exit)."""
    global _counts, _observations
    with _buffer_lock:
        counts, observations = _counts, _observations
        _counts, _observations = {}, {}
        gauges = list(_gauges.items())
    for (name, tag), value in counts.items():
        get(name).inc(value, tags=_tags(name, tag))
    for (name, tag), values in observations.items():
        metric, tags = get(name), _tags(name, tag)
        for v in values:
            metric.observe(v, tags=tags)
    for (name, tag), value in gauges:  # again: Ray's agent forgets a gauge that is not reported for a while
        get(name).set(value, tags=_tags(name, tag))


def _start_flusher() -> None:
    global _flusher
    with _buffer_lock:
        if _flusher is not None:
            return

        def loop() -> None:
            while True:
                time.sleep(FLUSH_INTERVAL_S)
                _flush_quietly()

        _flusher = threading.Thread(target=loop, name="specserve-metrics", daemon=True)
        _flusher.start()
        atexit.register(_flush_quietly)


def _flush_quietly() -> None:
    try:
        flush()
    except Exception:  # noqa: BLE001 - metrics must never take a replica down (nor spoil its exit)
        pass


# -- what the Serve layer calls ---------------------------------------------------------------------------

def record_step(num_draft: Sequence[int], num_accepted: Sequence[int], step_seconds: float | None = None,
                ) -> None:
    """One batched step: per request row, how many draft tokens were proposed and how many accepted.

    Every row emits num_accepted + 1 tokens (the recovered or bonus token). Per-position counts are
    aggregated over the batch first, so the cost is O(K) metric updates per step, not O(B*K).
    """
    assert len(num_draft) == len(num_accepted), f"{len(num_draft)} draft rows, {len(num_accepted)} accepted"
    rows = len(num_draft)
    if rows == 0:
        return
    max_k = max(num_draft)
    proposed = [0] * (max_k + 1)  # proposed[i]: rows with a draft token at position i
    accepted = [0] * (max_k + 1)
    for k, n in zip(num_draft, num_accepted):
        assert 0 <= n <= k, f"accepted {n} of {k} draft tokens"
        proposed[k] += 1  # difference arrays: position i < k counts
        accepted[n] += 1
    total_draft, total_accepted = sum(num_draft), sum(num_accepted)
    # Turn "rows whose count is exactly k" into "rows whose count is > i", from the top.
    proposed_gt = accepted_gt = 0
    by_position: list[tuple[str, int, int]] = []
    for i in range(max_k, 0, -1):
        proposed_gt += proposed[i]
        accepted_gt += accepted[i]
        by_position.append((str(min(i - 1, MAX_POSITION_LABEL)), proposed_gt, accepted_gt))
    with _buffer_lock:  # one lock, plain dict updates: a few microseconds per step
        c = _counts
        for name, value in (("specserve_steps_total", rows), ("specserve_draft_tokens_total", total_draft),
                            ("specserve_accepted_tokens_total", total_accepted),
                            ("specserve_emitted_tokens_total", total_accepted + rows)):
            c[(name, None)] = c.get((name, None), 0.0) + value
        for label, p, a in by_position:
            kp = ("specserve_draft_position_proposed_total", label)
            ka = ("specserve_draft_position_accepted_total", label)
            c[kp] = c.get(kp, 0.0) + p
            c[ka] = c.get(ka, 0.0) + a
        for n, count in enumerate(accepted):
            if count:
                key = ("specserve_steps_by_accepted_total", str(n))
                c[key] = c.get(key, 0.0) + count
        if step_seconds is not None:
            _observations.setdefault(("specserve_step_latency_seconds", None), []).append(step_seconds)
    if _flusher is None:
        _start_flusher()


def record_prespec(num_accepted: int, hit: bool) -> None:
    """A step verified while the next one was pre-speculated: its accepted length, and whether a branch matched."""
    label = str(min(num_accepted, MAX_POSITION_LABEL))
    _inc("specserve_prespec_steps_total", 1.0, label)
    if hit:
        _inc("specserve_prespec_hits_total", 1.0, label)


def record_draft_latency(seconds: float, scope: str = "call") -> None:
    """scope: 'call' (round trip seen by the coordinator) or 'compute' (inside the drafter replica)."""
    _observe("specserve_draft_latency_seconds", seconds, scope)


def record_verify_latency(seconds: float, scope: str = "call") -> None:
    """scope: 'call' (round trip seen by the coordinator) or 'compute' (inside the target replica)."""
    _observe("specserve_verify_latency_seconds", seconds, scope)


def set_queue_depth(waiting: int, stage: str) -> None:
    """Calls left queued in a worker after it took a batch (they wait for the next pass)."""
    _set("specserve_queue_depth", waiting, stage)


def set_active_requests(active: int) -> None:
    _set("specserve_active_requests", active)


def set_admission_queue(waiting: int, stage: str) -> None:
    """Requests waiting for a KV-cache slot in one worker (set once at start, so the series exists from then)."""
    _set("specserve_admission_queue_length", waiting, stage)


def record_admission_wait(seconds: float, stage: str) -> None:
    _observe("specserve_admission_wait_seconds", seconds, stage)


def record_admission_rejection(stage: str) -> None:
    _inc("specserve_admission_rejections_total", 1.0, stage)


def record_preemption(stage: str) -> None:
    _inc("specserve_preemptions_total", 1.0, stage)


class RequestTimer:
    """Per-request latency bookkeeping where tokens are streamed (ingress or coordinator).

    TPOT is (last token - first token) / (tokens - 1); the request latency runs from creation to finish.

        timer = metrics.RequestTimer(prompt_tokens=len(prompt), span=tracing.start_span("request"))
        for chunk in stream: timer.on_tokens(len(chunk)); yield chunk
        timer.finish("ok")   # or "error", "cancelled", ...
    """

    __slots__ = ("_clock", "_start", "_first", "_last", "_tokens", "_prompt_tokens", "_done", "_span")

    def __init__(self, prompt_tokens: int = 0, clock: Callable[[], float] = time.perf_counter,
                 span: Any = None):
        self._span = span  # a tracing span (deployments.tracing.start_span) ended by finish()
        self._clock = clock
        self._start = clock()
        self._first: float | None = None
        self._last: float | None = None
        self._tokens = 0
        self._prompt_tokens = prompt_tokens
        self._done = False

    def on_tokens(self, count: int) -> None:
        """`count` tokens were just sent to the client (one chunk)."""
        if count <= 0:
            return
        now = self._clock()
        if self._first is None:
            self._first = now
            _observe("specserve_ttft_seconds", now - self._start)
        else:
            _observe("specserve_inter_token_latency_seconds", now - self._last)
        self._last = now
        self._tokens += count
        _inc("specserve_generated_tokens_total", count)

    def finish(self, status: str = "ok") -> None:
        """Record the request's outcome once (later calls are ignored)."""
        if self._done:
            return
        self._done = True
        now = self._clock()
        _inc("specserve_requests_total", 1, status)
        _observe("specserve_request_latency_seconds", now - self._start)
        if self._prompt_tokens:
            _inc("specserve_prompt_tokens_total", self._prompt_tokens)
        if self._tokens > 1:
            per_token = (self._last - self._first) / (self._tokens - 1)
            _observe("specserve_time_per_output_token_seconds", per_token)
        if self._span is not None:
            from deployments import tracing

            tracing.set_attributes(self._span, status=status, completion_tokens=self._tokens,
                                   ttft_ms=None if self._first is None else (self._first - self._start) * 1e3)
            self._span.end()
