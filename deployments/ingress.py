"""The OpenAI-compatible HTTP ingress (FastAPI on Serve).

Routes are a table (`ENDPOINTS`) applied to a plain class by `make_ingress` (the Ray Serve LLM pattern).
A request is validated and tokenized here, then streamed from a coordinator as per-step events; the same
event stream feeds SSE chunks (`stream: true`) and the aggregated JSON response.

Coordinator loss: the event stream is resumed on another coordinator replica from the last delivered
event index (`Coordinator.resume`); events are deduplicated by index, and the resumed coordinator
regenerates unpersisted steps identically from (seed, step). Client reconnects: a POST with header
`Last-Event-ID: {request_id}:{index}` streams the events after `index`: from Redis, then, if the request is
not finished (its work was cancelled when the client went away), newly generated ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import types
import typing
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deployments import metrics, tracing  # tracing is a no-op unless OTEL_EXPORTER_OTLP_ENDPOINT is set
from deployments.config import NO_DRAFT, AppConfig
from deployments.messages import ErrorEvent, GenerateRequest, StepEvent
from deployments.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    completion_chunk,
    full_response,
    models_list,
    now,
    parse_request,
    resolve_max_tokens,
    usage,
    usage_chunk,
)
from deployments.redis_state import RequestStore, redis_url_getter
from deployments.sse import event_id, parse_event_id, sse_stream
from pipeline.models.loader import load_tokenizer

logger = logging.getLogger("ray.serve." + __name__)  # Serve's replica logger: its file, level and request ids

MAX_FAILOVERS = 5  # coordinator losses one request survives


# After a request's last event, how long its coordinator gets to end the stream by itself (it gives the request's
# KV-cache slots back and writes the final state to Redis: milliseconds) before it is cancelled.
RUN_OUT_S = 5.0


async def _run_out(stream: Any) -> None:
    """Let a finished request's coordinator stream end by itself, rather than cancel it: Serve's cancel reaches the
    calls the coordinator has just made (the slot releases, the last Redis write) and can drop them."""
    async def rest() -> None:
        async for _ in stream:
            pass

    try:
        await asyncio.wait_for(rest(), RUN_OUT_S)
    except Exception:  # noqa: BLE001 - late or failed: the coordinator's idle reclaim and TTLs cover it
        stream.cancel()


class _NotStarted(Exception):
    """A resumed request was never stored: start it again."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")  # Python's json module would accept NaN and Infinity


@contextlib.contextmanager
def _tokenizing(param: str) -> Iterator[None]:
    """Tokenizer failures on the client's text (whatever got past validation) are a 400 naming the field."""
    try:
        yield
    except Exception as err:
        template = type(err).__module__.startswith("jinja2")  # the chat template refused the messages (raise_exception)
        if not (template or isinstance(err, (TypeError, ValueError, UnicodeError))):
            raise
        logger.info("the tokenizer refused the %s: %s", param, type(err).__name__)
        why = f"the chat template refused them: {err}" if template else f"could not be tokenized ({type(err).__name__})"
        raise APIError(f"{param}: {why}", param=param, code="invalid_value") from None


def _error_response(request: Request, err: APIError) -> JSONResponse:
    """The error as OpenAI's body, and one log line: method, path, status, code and parameter, never the text
    (none for 499, a client gone: logged where it was seen)."""
    log = logger.warning if err.status >= 500 else logger.debug if err.status == 499 else logger.info
    log("%s %s -> %d %s%s", request.method, request.url.path, err.status, err.code,
        f" (param {err.param!r})" if err.param else "")
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class OpenAIIngress:
    async def __init__(self, config: dict[str, Any], coordinator: Any, redis: Any = None) -> None:
        self.cfg = AppConfig.model_validate(config)
        self.coord = coordinator
        info = await coordinator.model_info.remote()
        self.info = info
        self.model_name = self.cfg.served_model_name or info["name"]
        self.max_seq_len = int(info["max_seq_len"])
        self.vocab_size = int(info["vocab_size"])
        self.has_drafter = info["drafter"] != NO_DRAFT
        self.tokenizer = None
        if info["has_tokenizer"]:
            self.tokenizer = load_tokenizer(info["path"])
        self.store = await RequestStore.connect(redis_url_getter(self.cfg, redis), self.cfg.redis_namespace,
                                                self.cfg.request_ttl_s)
        self.created = now()
        self.key_digests = [_digest(k.get_secret_value()) for k in self.cfg.ingress.api_keys]

    # -- routes ----------------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except APIError as err:
            return _error_response(request, err)
        return JSONResponse(models_list(self.model_name, self.created, self.max_seq_len))

    async def completions(self, request: Request):
        return await self._handle("completion", request)

    async def chat_completions(self, request: Request):
        return await self._handle("chat", request)

    # -- handling ----------------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        """OpenAI's `Authorization: Bearer KEY`, when keys are configured; a missing or wrong key is a 401. Every
        configured key is compared (digests, in constant time), so the time taken says nothing about the key."""
        if not self.key_digests:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            raise APIError("You didn't provide an API key. Send it in the Authorization header as 'Bearer KEY'.",
                           401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        digest, match = _digest(given), False
        for want in self.key_digests:
            match |= hmac.compare_digest(digest, want)
        if not match:
            raise APIError("Incorrect API key provided.", 401, code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _handle(self, kind: str, request: Request):
        try:
            self._authorize(request)
            body = await self._read_json(request)
            last_event_id = request.headers.get("last-event-id")
            if last_event_id:
                return await self._resume(kind, last_event_id)
            req = parse_request(kind, body)
            if req.model != self.model_name:
                raise APIError(f"The model '{req.model}' does not exist; this server serves "
                               f"'{self.model_name}'", 404, param="model", code="model_not_found")
            if req.stop and self.tokenizer is None:
                raise APIError("stop strings need a tokenizer; this model has none", param="stop",
                               code="unsupported")
            prompt_ids = self._encode(kind, req)
            max_tokens = resolve_max_tokens(
                req.max_tokens if kind == "completion" else req.effective_max_tokens(), len(prompt_ids),
                self.max_seq_len)
            params = req.sampling_params(max_tokens)
            spec = req.spec_params(self.cfg.speculation.num_draft_tokens, self.cfg.speculation.draft_top_k,
                                   self.has_drafter)
        except APIError as err:
            return _error_response(request, err)

        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        # The request's root span (a child of the client's `traceparent`, if any); the timer ends it.
        span = tracing.start_span(f"POST {request.url.path}", parent=dict(request.headers), request_id=rid,
                                  prompt_tokens=len(prompt_ids), max_tokens=max_tokens, k=spec.num_draft_tokens)
        payload = GenerateRequest(request_id=rid, kind=kind, model=self.model_name, created=now(),
                                  prompt_ids=prompt_ids, params=params, spec=spec, trace=tracing.carrier_of(span))
        events = self._events(rid, lambda: self.coord.options(stream=True).generate.remote(payload))
        timer = metrics.RequestTimer(len(prompt_ids), span=span)
        if req.stream:
            try:  # the first step awaited here: a request refused admission gets its HTTP status (429)
                events = await _started(events)
            except APIError as err:
                timer.finish("error")
                return self._error(request, err)
            chunks = self._chunks(kind, rid, payload.created, events, req.include_usage, timer)
            return StreamingResponse(sse_stream(chunks), media_type="text/event-stream",
                                     headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})
        return await self._aggregate(request, kind, rid, payload.created, events, timer)

    def _error(self, request: Request, err: APIError) -> JSONResponse:
        """An error of the request's generation as a response; a 429 (every slot queue full) says when to retry."""
        if err.status == 429 and not err.headers:
            err.headers = {"Retry-After": str(self.cfg.coordinator.retry_after_s)}
        return _error_response(request, err)

    async def _read_json(self, request: Request) -> Any:
        limit = self.cfg.ingress.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413,
                           code="request_too_large")
        chunks, size = [], 0
        timeout_s = self.cfg.ingress.body_read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # a body that never arrives in full must not hold its connection
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(f"request body exceeds the limit of {limit} bytes", 413,
                                       code="request_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(f"the request body did not arrive in full within {timeout_s:g} s ({size} bytes came)",
                           408, code="request_timeout", headers={"Connection": "close"}) from None
        except (ClientDisconnect, asyncio.CancelledError, TaskCancelledError) as err:  # the client went away
            logger.info("%s %s: the client went away mid-upload, after %d bytes of its request body",
                        request.method, request.url.path, size)
            if isinstance(err, ClientDisconnect):  # the ASGI server saw it (Serve did not cancel this request)
                raise APIError(f"the client went away mid-upload, after {size} bytes of its request body", 499,
                               code="client_disconnected") from None
            raise  # Serve's proxy saw it and cancelled this request
        raw = b"".join(chunks)
        if not raw.strip():
            if request.headers.get("last-event-id"):
                return {}
            raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(f"malformed JSON body: {err}", code="invalid_json") from None
        except ValueError as err:
            raise APIError(f"malformed JSON body: {err}", code="invalid_json") from None

    def _encode(self, kind: str, req: Any) -> list[int]:
        if kind == "completion":
            if isinstance(req.prompt, list):
                bad = [t for t in req.prompt if t >= self.vocab_size]
                if bad:
                    raise APIError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})",
                                   param="prompt", code="invalid_value")
                return list(req.prompt)
            if self.tokenizer is None:
                raise APIError("this model has no tokenizer: send the prompt as a list of token ids",
                               param="prompt", code="unsupported")
            with _tokenizing("prompt"):
                return list(self.tokenizer(req.prompt)["input_ids"])
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model has no chat template: use /v1/completions", param="messages",
                           code="unsupported")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        with _tokenizing("messages"):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def _resume(self, kind: str, last_event_id: str) -> Any:
        rid, after = parse_event_id(last_event_id)
        stored = await self.store.load(rid)
        if stored is None:
            raise APIError(f"unknown or expired request id {rid!r}", 404, param="Last-Event-ID",
                           code="request_not_found")
        if stored.kind != kind:
            raise APIError(f"request {rid} is a {stored.kind} request; resume it on its own endpoint",
                           param="Last-Event-ID", code="invalid_value")
        if stored.finished:
            events = self._stored_events(rid, after)
        else:
            events = self._events(rid, lambda: self.coord.options(stream=True).resume.remote(rid, after), after)
        created = int(stored.fields.get("created", now()))
        chunks = self._chunks(kind, rid, created, events, True, None)
        return StreamingResponse(sse_stream(chunks), media_type="text/event-stream",
                                 headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})

    async def _stored_events(self, rid: str, after: int) -> AsyncIterator[StepEvent]:
        for ev in await self.store.events(rid, after + 1):
            yield StepEvent.from_json(ev)

    async def _events(self, rid: str, start: Callable[[], Any], after: int = -1) -> AsyncIterator[StepEvent]:
        """Events of one request from a coordinator, surviving coordinator loss (dedup by index)."""
        delivered = after
        stream = start()
        failovers = 0
        resuming = False
        finished = False
        try:
            while True:
                try:
                    async for batch in stream:  # the coordinator yields lists of per-step events
                        for ev in batch:
                            if isinstance(ev, ErrorEvent):
                                e = ev.error
                                if resuming and delivered == after and e.get("code") == "request_not_found":
                                    raise _NotStarted  # the lost coordinator died before storing it
                                raise APIError(e["message"], ev.status, e.get("type", "server_error"),
                                               e.get("param"), e.get("code"))
                            if ev.i <= delivered:
                                continue
                            delivered = ev.i
                            finished = bool(ev.finish)
                            yield ev
                            if finished:
                                await _run_out(stream)
                                return
                    return
                except (RayActorError, ActorUnavailableError) as err:
                    failovers += 1
                    if failovers > MAX_FAILOVERS:
                        raise APIError("the coordinators kept failing", 503, "server_error",
                                       code="coordinator_unavailable") from err
                    logger.warning("coordinator lost during %s (%s); resuming after event %d", rid,
                                   type(err).__name__, delivered)
                    await asyncio.sleep(0.1 * failovers)
                    stream = self.coord.options(stream=True).resume.remote(rid, delivered)
                    resuming = True
                except _NotStarted:
                    stream, resuming = start(), False
        finally:
            if not finished:
                stream.cancel()  # client gone or failed: stop the coordinator's loop for this request

    async def _chunks(
        self, kind: str, rid: str, created: int, events: AsyncIterator[StepEvent], include_usage: bool, timer: Any
    ) -> AsyncIterator[tuple[Optional[str], dict]]:
        model = self.model_name
        status = "error"
        try:
            if kind == "chat":
                yield None, chat_chunk(rid, created, model, "", None, first=True)
            async for ev in events:
                if kind == "completion":
                    chunk = completion_chunk(rid, created, model, ev.text, ev.finish)
                else:
                    chunk = chat_chunk(rid, created, model, ev.text, ev.finish)
                chunk["choices"][0]["token_ids"] = ev.ids
                if timer is not None:
                    timer.on_tokens(len(ev.ids))
                yield event_id(rid, ev.i), chunk
                if ev.finish and include_usage and ev.usage is not None:
                    u = ev.usage
                    yield None, usage_chunk(kind, rid, created, model,
                                            usage(u["prompt_tokens"], u["completion_tokens"]), ev.speculation or {})
            status = "ok"
        except asyncio.CancelledError:
            status = "cancelled"
            logger.info("%s: the client went away mid-stream; its generation is cancelled", rid)
            raise
        finally:
            if timer is not None:
                timer.finish(status)

    async def _aggregate(self, request: Request, kind: str, rid: str, created: int, events: AsyncIterator[StepEvent],
                         timer: Any):
        text, ids, finish, last = [], [], None, None
        try:
            async for ev in events:
                text.append(ev.text)
                ids += ev.ids
                if timer is not None:
                    timer.on_tokens(len(ev.ids))
                finish, last = ev.finish, ev
        except APIError as err:
            if timer is not None:
                timer.finish("error")
            return self._error(request, err)
        except asyncio.CancelledError:
            if timer is not None:
                timer.finish("cancelled")
            logger.info("%s: the client went away before its response; its generation is cancelled", rid)
            raise
        if timer is not None:
            timer.finish("ok")
        u = (last.usage if last is not None else None) or {"prompt_tokens": 0, "completion_tokens": len(ids)}
        spec = (last.speculation if last is not None else None) or {}
        body = full_response(kind, rid, created, self.model_name, "".join(text), finish,
                             usage(u["prompt_tokens"], u["completion_tokens"]), spec)
        body["choices"][0]["token_ids"] = ids
        return JSONResponse(body, headers={"X-Request-Id": rid})


async def _started(events: AsyncIterator[StepEvent]) -> AsyncIterator[StepEvent]:
    """`events` with its first event already awaited (an error before it raises here)."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None

    async def chained() -> AsyncIterator[StepEvent]:
        try:
            if first is not None:
                yield first
                async for ev in events:
                    yield ev
        finally:
            await events.aclose()  # closed early (client gone): stop the coordinator's work

    return chained()


# -- the route table and the FastAPI app ---------------------------------------------------------------------

def _request_body(model: type) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that reads its body itself (`_read_json`): the pydantic model's JSON
    schema, its `$defs` inlined, so that /openapi.json describes what the route takes (clients, fuzzing)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


ENDPOINTS: dict[str, Callable[[FastAPI], Callable]] = {
    "health": lambda app: app.get("/health"),
    "models": lambda app: app.get("/v1/models"),
    "completions": lambda app: app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest)),
    "chat_completions": lambda app: app.post("/v1/chat/completions",
                                             openapi_extra=_request_body(ChatCompletionRequest)),
}


def make_fastapi_app() -> FastAPI:
    app = FastAPI(title="specserve", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error_response(request, APIError(str(err.detail), err.status_code, code=str(err.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return _error_response(request, APIError(str(err), 400))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> JSONResponse:
        if isinstance(err, TaskCancelledError):  # Serve cancelled the request, its client gone (logged where seen)
            logger.debug("%s %s: cancelled by Serve, the client went away", request.method, request.url.path)
            return JSONResponse(APIError("the client went away", 499, code="client_disconnected").body(),
                                status_code=499)
        logger.exception("unhandled error")
        return JSONResponse(APIError(f"internal error: {type(err).__name__}", 500, "internal_error",
                                     code="internal_error").body(), status_code=500)

    return app


def make_ingress(cls: type = OpenAIIngress, app: Optional[FastAPI] = None) -> type:
    """Apply the route table to a subclass of `cls` and wrap it with `serve.ingress`."""
    app = app or make_fastapi_app()
    routed = {name: route(app)(_fresh_copy(getattr(cls, name))) for name, route in ENDPOINTS.items()}
    new_cls = type(cls.__name__, (cls,), routed)
    new_cls.__qualname__ = cls.__qualname__
    return serve.ingress(app)(new_cls)


def _fresh_copy(fn: Callable) -> Callable:
    """A copy of a function, so that it is pickled by value: Serve rewrites the route's signature (to inject
    `self`) on the function object, and a function pickled by reference would lose that in the replica."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    # Resolved annotations (this module uses `from __future__ import annotations`): FastAPI must see the
    # class `Request`, and the by-value copy's globals in the replica hold only the names its code uses.
    copy.__annotations__ = typing.get_type_hints(fn)
    return copy
