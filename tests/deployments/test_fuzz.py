"""Fuzzing the running app through its OpenAPI schema: Schemathesis draws request bodies from the schema the app
publishes (`/openapi.json`), valid ones (positive) and ones that break it (negative: wrong types, missing fields,
bytes that are not JSON), plus any JSON value at all; httpx sends them to real Serve on loopback. Not one answer may
be a 5xx, nor a streamed error event of one.

A fixed budget: derandomized Hypothesis (the same examples every run), a fixed number of examples per test, and
max_tokens capped at 3 so that a valid request costs a few target passes."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.edge_app import AUTH, MODEL, edge_app
from tests.support.serve import sse_events

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")

MAX_TOKENS = 3
BUDGET = settings(max_examples=30, derandomize=True, database=None, deadline=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def server(demo_path):
    return edge_app(demo_path)


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_dict(httpx.get(f"{server}/openapi.json", timeout=30).json())


def test_the_schema_describes_the_request_bodies(schema):
    for route in ROUTES:
        body = schema.raw_schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model", "max_tokens", "stream", "seed"} <= set(body["properties"]), body
        assert "model" in body["required"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def capped(body):
    """The body with its token budget capped (where it is an integer) and, mostly, the served model's name, so that
    the examples reach generation instead of stopping at the model check."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[field] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # absent or null: the whole context
    return body


def send(server, route, body):
    """POST `body` (JSON, or bytes as they are); fail on a 5xx answer or a 5xx error streamed inside a 200."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", f"{server}{route}", content=content, timeout=120,
                      headers={**AUTH, "content-type": "application/json"}) as r:
        if r.status_code != 200:
            r.read()
            assert r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text
            return r.status_code
        if r.headers["content-type"].startswith("text/event-stream"):
            for _, data in sse_events(r.iter_lines()):
                if isinstance(data, dict) and "error" in data:
                    assert data["error"].get("type") != "internal_error", (body, data)
        else:
            r.read()
            assert "choices" in r.json(), r.text
        return r.status_code


def cases(schema, route, mode):
    return schema[route]["POST"].as_strategy(generation_mode=getattr(schemathesis.GenerationMode, mode))


@pytest.mark.parametrize("route", ROUTES)
def test_valid_bodies_never_get_a_5xx(server, schema, route):
    @BUDGET
    @given(case=cases(schema, route, "POSITIVE"), served_model=st.booleans())
    def check(case, served_model):
        body = case.body
        if served_model and isinstance(body, dict):
            body["model"] = MODEL  # mostly past the model check, into tokenization and generation
        send(server, route, capped(body))

    check()


@pytest.mark.parametrize("route", ROUTES)
def test_invalid_bodies_never_get_a_5xx(server, schema, route):
    @BUDGET
    @given(case=cases(schema, route, "NEGATIVE"), served_model=st.booleans())
    def check(case, served_model):
        body = case.body
        if served_model and isinstance(body, dict):
            body["model"] = MODEL
        send(server, route, capped(body))

    check()


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_with_one_field_replaced_never_get_a_5xx(server, schema, route):
    @BUDGET
    @given(case=cases(schema, route, "POSITIVE"), value=JSON, data=st.data())
    def check(case, value, data):
        body = {**case.body, "model": MODEL}
        body[data.draw(st.sampled_from(sorted(body)))] = value
        send(server, route, capped(body))

    check()


@pytest.mark.parametrize("route", ROUTES)
def test_any_json_never_gets_a_5xx(server, route):
    @BUDGET
    @given(body=JSON | st.dictionaries(st.sampled_from(["model", "prompt", "messages", "stream", "max_tokens"]),
                                       JSON, max_size=5))
    def check(body):
        send(server, route, capped(body))

    check()
