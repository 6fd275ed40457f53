"""deployments.metrics with the prometheus_client backend: the values a scrape shows."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deployments import metrics


@pytest.fixture
def scrape():
    registry = CollectorRegistry()
    metrics.use_registry(registry)

    def read() -> dict[tuple, float]:
        """{(sample name, sorted label items): value} from the exposition text, as Prometheus reads it."""
        metrics.flush()
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    yield read
    metrics.use_registry(None)


def test_every_metric_name_is_valid_and_counters_end_in_total():
    for name, d in metrics.DEFS.items():
        assert name.startswith("specserve_")
        assert (d.kind == "counter") == name.endswith("_total"), name
        assert (d.kind == "histogram") == bool(d.buckets), name


def test_record_step_counts_acceptance_overall_and_by_position(scrape):
    # Three rows: K=4 with 4 accepted (bonus), K=4 with 1 accepted, K=2 (prompt lookup) with 0 accepted.
    metrics.record_step([4, 4, 2], [4, 1, 0], step_seconds=0.012)
    metrics.record_step([4], [2])
    v = scrape()
    assert v[("specserve_steps_total", ())] == 4
    assert v[("specserve_draft_tokens_total", ())] == 14
    assert v[("specserve_accepted_tokens_total", ())] == 7
    assert v[("specserve_emitted_tokens_total", ())] == 11  # 7 accepted + one token per row
    proposed = {i: v[("specserve_draft_position_proposed_total", (("position", str(i)),))] for i in range(4)}
    accepted = {i: v[("specserve_draft_position_accepted_total", (("position", str(i)),))] for i in range(4)}
    assert proposed == {0: 4, 1: 4, 2: 3, 3: 3}
    assert accepted == {0: 3, 1: 2, 2: 1, 3: 1}
    by_accepted = {labels[0][1]: value for (name, labels), value in v.items()
                   if name == "specserve_steps_by_accepted_total"}
    assert by_accepted == {"0": 1, "1": 1, "2": 1, "4": 1}
    assert v[("specserve_step_latency_seconds_count", ())] == 1
    assert v[("specserve_step_latency_seconds_sum", ())] == pytest.approx(0.012)


def test_record_step_rejects_more_accepted_than_drafted(scrape):
    with pytest.raises(AssertionError, match="accepted 3 of 2"):
        metrics.record_step([2], [3])


def test_request_timer_ttft_itl_tpot_and_tokens(scrape):
    now = [100.0]
    timer = metrics.RequestTimer(prompt_tokens=7, clock=lambda: now[0])
    now[0] = 100.25
    timer.on_tokens(1)  # TTFT 0.25
    now[0] = 100.30
    timer.on_tokens(3)  # gap 0.05
    now[0] = 100.32
    timer.on_tokens(0)  # nothing sent: ignored
    now[0] = 100.40
    timer.on_tokens(2)  # gap 0.10
    now[0] = 100.50
    timer.finish("ok")
    timer.finish("error")  # once only
    v = scrape()
    assert v[("specserve_ttft_seconds_sum", ())] == pytest.approx(0.25)
    assert v[("specserve_inter_token_latency_seconds_count", ())] == 2
    assert v[("specserve_inter_token_latency_seconds_sum", ())] == pytest.approx(0.15)
    assert v[("specserve_generated_tokens_total", ())] == 6
    assert v[("specserve_prompt_tokens_total", ())] == 7
    assert v[("specserve_requests_total", (("status", "ok"),))] == 1
    assert ("specserve_requests_total", (("status", "error"),)) not in v
    assert v[("specserve_request_latency_seconds_sum", ())] == pytest.approx(0.5)
    assert v[("specserve_time_per_output_token_seconds_sum", ())] == pytest.approx(0.15 / 5)


def test_latency_and_gauges(scrape):
    metrics.record_draft_latency(0.004, scope="call")
    metrics.record_draft_latency(0.003, scope="compute")
    metrics.record_verify_latency(0.02)
    metrics.set_queue_depth(5, stage="target")
    metrics.set_active_requests(3)
    metrics.set_queue_depth(2, stage="target")
    metrics.set_queue_depth(1, stage="drafter")
    v = scrape()
    assert v[("specserve_draft_latency_seconds_count", (("scope", "call"),))] == 1
    assert v[("specserve_draft_latency_seconds_count", (("scope", "compute"),))] == 1
    assert v[("specserve_verify_latency_seconds_sum", (("scope", "call"),))] == pytest.approx(0.02)
    assert v[("specserve_queue_depth", (("stage", "target"),))] == 2
    assert v[("specserve_queue_depth", (("stage", "drafter"),))] == 1
    assert v[("specserve_active_requests", ())] == 3


def test_flush_reports_every_gauge_again(scrape):
    """Ray's agent drops a gauge no process re-reports; the flush sets each gauge's last value again."""
    metrics.set_active_requests(16)
    metrics.set_queue_depth(4, stage="target")
    assert scrape()[("specserve_active_requests", ())] == 16
    metrics.get("specserve_active_requests").set(0)  # the backend lost the value (as Ray's agent does)
    metrics.get("specserve_queue_depth").set(0, tags={"stage": "target"})
    v = scrape()  # flushes
    assert v[("specserve_active_requests", ())] == 16
    assert v[("specserve_queue_depth", (("stage", "target"),))] == 4


def test_request_timer_ends_its_span_with_the_outcome(scrape):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from deployments import tracing

    exporter = InMemorySpanExporter()
    tracing.configure(exporter, simple=True)
    try:
        timer = metrics.RequestTimer(3, span=tracing.start_span("POST /v1/completions"))
        timer.on_tokens(2)
        timer.finish("ok")
        (span,) = exporter.get_finished_spans()
        assert span.attributes["specserve.status"] == "ok"
        assert span.attributes["specserve.completion_tokens"] == 2
        assert span.attributes["specserve.ttft_ms"] >= 0
    finally:
        tracing.disable()


def test_buffered_records_reach_the_registry_without_an_explicit_flush():
    import time

    registry = CollectorRegistry()
    metrics.use_registry(registry)
    try:
        metrics.record_step([3], [1])
        deadline = time.monotonic() + 5 * metrics.FLUSH_INTERVAL_S
        while registry.get_sample_value("specserve_draft_tokens_total") != 3:
            assert time.monotonic() < deadline, "the flusher thread did not push the buffered counts"
            time.sleep(0.05)
    finally:
        metrics.use_registry(None)
