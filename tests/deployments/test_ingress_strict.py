"""The HTTP edge refuses what OpenAI's API refuses, and keeps serving: text that is not Unicode (lone surrogate
escapes) and strict types are 400s naming the field, a body that stops short of its Content-Length gets 408 and its
connection closed, and client errors and disconnects log one line each, never a traceback nor the prompt. Real
Serve, the demo target (its tokenizer and chat template), httpx and raw sockets."""

from __future__ import annotations

import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.edge_app import AUTH, BODY_READ_TIMEOUT_S, MODEL, app_log, edge_app, ingress_log

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(demo_path):
    return edge_app(demo_path)


def post(server, path, body, headers=AUTH, timeout=60):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps keeps "\ud800" an escape
    return httpx.post(f"{server}{path}", content=content, headers={**headers, "content-type": "application/json"},
                      timeout=timeout)


def assert_openai_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_serving(server):
    ok = post(server, COMPLETIONS, {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def message(content):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


UNENCODABLE = [
    ("chat message", CHAT, message("hi \ud800 there"), "messages.0.content"),
    ("chat content part", CHAT, message([{"type": "text", "text": "\udfff"}]), "messages.0.content.0.text"),
    ("prompt", COMPLETIONS, {"model": MODEL, "prompt": "\udfff", "max_tokens": 2}, "prompt"),
    ("prompt in a list", COMPLETIONS, {"model": MODEL, "prompt": ["ok \ud800"], "max_tokens": 2}, "prompt.0"),
    ("stop string", COMPLETIONS, {"model": MODEL, "prompt": "Hi", "stop": "\ud800"}, "stop"),
    ("stop list", CHAT, {**message("Hi"), "stop": ["ok", "a\udbff"]}, "stop.1"),
    ("model", COMPLETIONS, {"model": "\ud800", "prompt": "Hi"}, "model"),
]


@pytest.mark.parametrize("name, path, body, param", UNENCODABLE, ids=[c[0] for c in UNENCODABLE])
def test_text_that_is_not_unicode_is_a_400_naming_its_field(server, name, path, body, param):
    assert "\\ud" in json.dumps(body) or "\\udf" in json.dumps(body)  # the escape is on the wire, as a client sends it
    err = assert_openai_error(post(server, path, body), 400, param=param, code="invalid_value")
    assert "surrogate" in err["message"]
    assert_serving(server)


STRICT = [
    ("stream as a string", COMPLETIONS, {"stream": "yes"}, "stream"),
    ("max_tokens as a string", COMPLETIONS, {"max_tokens": "8"}, "max_tokens"),
    ("max_tokens as a float", COMPLETIONS, {"max_tokens": 8.0}, "max_tokens"),
    ("seed as a string", COMPLETIONS, {"seed": "5"}, "seed"),
    ("temperature as a string", CHAT, {"temperature": "0.5"}, "temperature"),
    ("temperature as a boolean", CHAT, {"temperature": True}, "temperature"),
    ("top_p as a string", CHAT, {"top_p": "1"}, "top_p"),
    ("ignore_eos as a number", COMPLETIONS, {"ignore_eos": 1}, "ignore_eos"),
    ("stream_options as a string", CHAT, {"stream": True, "stream_options": {"include_usage": "no"}},
     "stream_options.include_usage"),
    ("K as a string", COMPLETIONS, {"speculation": {"num_draft_tokens": "3"}}, "speculation.num_draft_tokens"),
    ("token ids with a boolean", COMPLETIONS, {"prompt": [1, True, 3]}, "prompt"),
    ("a number as the prompt", COMPLETIONS, {"prompt": 5}, "prompt"),
    ("stop as a number", COMPLETIONS, {"stop": 5}, "stop"),
    ("role as a number", CHAT, {"messages": [{"role": 1, "content": "hi"}]}, "messages.0.role"),
    ("NaN temperature", COMPLETIONS, b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL.encode(), None),
]


@pytest.mark.parametrize("name, path, fields, param", STRICT, ids=[c[0] for c in STRICT])
def test_loose_types_are_refused_not_coerced(server, name, path, fields, param):
    if isinstance(fields, bytes):
        body = fields
    else:
        base = {"model": MODEL, "max_tokens": 2}
        base.update({"prompt": "Hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "Hi"}]})
        body = {**base, **fields}
    err = assert_openai_error(post(server, path, body), 400, param=param)
    assert err["code"] in ("invalid_value", "invalid_json")


ACCEPTED = [
    ("stop as a string", COMPLETIONS, {"stop": "."}),
    ("stop as a list", COMPLETIONS, {"stop": [".", "\n"]}),
    ("integer temperature and top_p", CHAT, {"temperature": 1, "top_p": 1, "seed": 5}),
    ("null fields", CHAT, {"seed": None, "stop": None, "stream_options": None, "max_completion_tokens": None}),
    ("unknown OpenAI fields", CHAT, {"user": "u-1", "metadata": {"a": "b"}}),
]


@pytest.mark.parametrize("name, path, fields", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_what_openai_accepts_is_accepted(server, name, path, fields):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "Hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "Hi"}]})
    r = post(server, path, {**base, **fields})
    assert r.status_code == 200, r.text


def _raw_request(server: str, path: str, body: bytes, content_length: int) -> socket.socket:
    url = urlsplit(server)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = (f"POST {url.path}{path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout of 30 s fails the test)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closed(server):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    sock = _raw_request(server, COMPLETIONS, body, len(body) + 100)  # 100 bytes promised and never sent
    try:
        reply = _read_until_closed(sock)  # the server closes it: the connection is not held
    finally:
        sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert b"connection: close" in head.lower(), head
    err = json.loads(payload)["error"]
    assert err["code"] == "request_timeout" and f"{BODY_READ_TIMEOUT_S:g} s" in err["message"], err
    assert_serving(server)


def test_client_errors_and_disconnects_log_one_line_each_without_traceback_or_text(server):
    marker = f"zebra-{uuid.uuid4().hex[:8]}"  # in every prompt below: it must not reach any log
    before = ingress_log()
    # a 400, a 401 and a 404
    assert_openai_error(post(server, COMPLETIONS, {"model": MODEL, "prompt": marker, "max_tokens": "8"}), 400)
    assert_openai_error(post(server, COMPLETIONS, {"model": MODEL, "prompt": marker}, headers={}), 401)
    assert_openai_error(post(server, COMPLETIONS, {"model": "gpt-" + marker, "prompt": marker}), 404)
    # a client that goes away mid-upload
    body = json.dumps({"model": MODEL, "prompt": marker, "max_tokens": 2}).encode()
    sock = _raw_request(server, COMPLETIONS, body[:20], len(body))
    time.sleep(0.5)
    sock.close()
    # a client that goes away mid-stream
    stream_body = {"model": MODEL, "prompt": marker, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}{COMPLETIONS}", json=stream_body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    # and one that completes, so the prompt passed the whole request path
    done = post(server, COMPLETIONS, {"model": MODEL, "prompt": marker, "max_tokens": 4})
    assert done.status_code == 200

    def new_lines():
        return ingress_log()[len(before):]

    def logged():
        text = new_lines()
        return ("went away mid-upload" in text and "went away mid-stream" in text
                and "-> 400 invalid_value (param 'max_tokens')" in text
                and "-> 401 invalid_api_key" in text and "-> 404 model_not_found" in text)

    deadline = time.monotonic() + 90  # the replica sees a stream's client gone at its next write
    while not logged() and time.monotonic() < deadline:
        time.sleep(0.5)
    text = new_lines()
    assert logged(), text
    assert "Traceback" not in text, text
    lines = text.splitlines()
    assert sum("went away mid-upload" in line for line in lines) == 1, text
    assert sum("went away mid-stream" in line for line in lines) == 1, text
    assert marker not in app_log()
    assert_serving(server)
