"""Cost of the ops hooks per step: tracing off/on, metrics recording (prometheus_client and Ray backends).

    python -m ops.bench_hooks        # prints a JSON table of microseconds per call (starts a local Ray)
"""

from __future__ import annotations

import json
import os
import time

import ray
from prometheus_client import CollectorRegistry

from deployments import metrics, tracing
from deployments.ray_env import apply_ray_defaults
from specserve.otlp_receiver import OTLPReceiver


def per_call_us(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    apply_ray_defaults()
    out: dict[str, float] = {}
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    tracing.disable()
    carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}

    def step():
        with tracing.span("coordinator.step", parent=carrier, step=3):
            tracing.inject()
            tracing.annotate(k=4, accepted=2, step_latency_ms=1.0)

    out["tracing off: span+inject+annotate"] = per_call_us(step, 20000)
    with OTLPReceiver() as receiver:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.http_endpoint
        tracing.configure()
        out["tracing on (OTLP/HTTP batch): span+inject+annotate"] = per_call_us(step, 2000)
        tracing.force_flush()
        tracing.disable()
        del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]

    metrics.use_registry(CollectorRegistry())
    out["prometheus_client: record_step B=1 K=4"] = per_call_us(lambda: metrics.record_step([4], [2], 0.01), 20000)
    metrics.use_registry(None)

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    def in_ray() -> dict[str, float]:
        metrics.reset()  # the worker's own copy of the module
        res = {
            "Ray: record_step B=1 K=4": per_call_us(lambda: metrics.record_step([4], [2], 0.01), 5000),
            "Ray: record_step B=8 K=4": per_call_us(
                lambda: metrics.record_step([4] * 8, [2, 0, 4, 1, 3, 2, 0, 4], 0.01), 2000),
        }
        for _ in range(1000):
            metrics.record_step([4], [2], 0.01)
        t = time.perf_counter()
        metrics.flush()
        res["Ray: flush, per B=1 step (background thread)"] = (time.perf_counter() - t) / 1000 * 1e6
        return res

    out.update(ray.get(in_ray.remote()))
    ray.shutdown()
    print(json.dumps({f"{k} (us)": round(v, 2) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
