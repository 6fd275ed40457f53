"""The OpenAI-compatible wire format: request models, response builders, and the one error type.

Requests are pydantic models (this is an edge). Responses are built as plain dicts: they are made once per
streamed chunk and need no validation. Every error a client can cause is an `APIError`, rendered in one
place as OpenAI's body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.config import InvalidParam, SamplingParams, SpecParams


class APIError(Exception):
    """An error that is the client's to see: HTTP status + OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers  # extra response headers (WWW-Authenticate, Connection: close)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# pydantic names the member of a union it tried in the error location ("prompt.list[int].0"): not a parameter.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*)$")


def find_unencodable(value: Any, path: str = "") -> Optional[str]:
    """The path (`messages.0.content`) of the first string in a decoded JSON value that is not valid Unicode
    (a lone surrogate escape such as "\\ud800", which JSON allows and UTF-8 cannot encode); None if all are."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items: Any = value.items()
        for key, item in items:
            found = find_unencodable(key, path) or find_unencodable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_unencodable(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error, as a 400 naming the offending parameter (its path: `messages.0.role`)."""
    first = err.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if not _UNION_TAG.match(str(x))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return APIError(f"{param}: {msg}" if param else msg, 400, param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------


class SpeculationOptions(BaseModel):
    """specserve's extension: how to speculate for this request (`extra_body={"speculation": {...}}`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_draft_tokens: Optional[int] = Field(None, ge=0, le=64, description="K; 0 is plain target decoding.")
    drafter: bool = Field(True, description="False: no drafter, plain target decoding.")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = True


class _SamplingFields(BaseModel):
    """The fields both endpoints take. Strict, as OpenAI's API: `"8"` is not an integer, `"yes"` not a boolean; an
    integer is a number (`"temperature": 1`)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # unknown OpenAI fields (user, ...) are ignored, like vLLM

    model: str
    max_tokens: Optional[int] = Field(None, description="Tokens to generate; None: up to the context.")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="Extension; 0 or -1: off.")
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    ignore_eos: bool = False
    speculation: Optional[SpeculationOptions] = None
    # Accepted only at their neutral values: anything else would change the output distribution.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[Any] = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"must be >= 0 (0 or -1: off), got {v}")
        return max(v, 0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def check_unsupported(self) -> None:
        if self.presence_penalty != 0.0:
            raise APIError("presence_penalty is not supported", param="presence_penalty", code="unsupported")
        if self.frequency_penalty != 0.0:
            raise APIError("frequency_penalty is not supported", param="frequency_penalty", code="unsupported")
        if self.logprobs not in (None, False, 0):
            raise APIError("logprobs are not supported", param="logprobs", code="unsupported")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams, seed fixed: where its sampling fields are validated (a bad one is a 400
        naming it); the object then travels to the coordinator as is."""
        try:
            return SamplingParams(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_tokens=max_tokens,
                stop=tuple(self.stop or ()), seed=self.seed, ignore_eos=self.ignore_eos,
            ).with_seed()
        except InvalidParam as err:
            raise APIError(str(err), 400, param=err.param, code="invalid_value") from None

    def spec_params(self, default_k: int, draft_top_k: int, has_drafter: bool) -> SpecParams:
        opts = self.speculation or SpeculationOptions()
        k = default_k if opts.num_draft_tokens is None else opts.num_draft_tokens
        if not opts.drafter or not has_drafter:
            k = 0
        return SpecParams(num_draft_tokens=k, draft_top_k=draft_top_k)

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage if self.stream_options else True


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    max_tokens: Optional[int] = 16  # OpenAI's default for completions

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, v: Any) -> Any:
        ids = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        texts = isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)
        if not (isinstance(v, str) or ids or texts):
            raise ValueError("must be a string, a list of one string, or a list of token ids (integers >= 0)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Union[str, list[int], list[str]]) -> Union[str, list[int]]:
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported: send one prompt per request")
                return v[0]
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
                raise ValueError("token-id prompts must be a list of non-negative integers")
        return v

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError("echo is not supported", param="echo", code="unsupported")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(f"content part of type {part.get('type')!r} is not supported",
                               param="messages", code="unsupported")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise APIError("a text content part's text must be a string", param="messages", code="invalid_value")
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None

    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @field_validator("max_completion_tokens")
    @classmethod
    def _mct(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v


def parse_request(kind: str, body: Any) -> Union[CompletionRequest, ChatCompletionRequest]:
    """Validate a decoded JSON body; every failure is a 400 APIError."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    bad = find_unencodable(body)
    if bad is not None:
        raise APIError(f"{bad}: the text holds a lone surrogate escape (\\ud800-\\udfff), which is not Unicode text",
                       param=bad, code="invalid_value")
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    try:
        req = cls.model_validate(body)
    except ValidationError as err:
        raise from_validation_error(err) from None
    req.check_unsupported()
    return req


def resolve_max_tokens(requested: Optional[int], prompt_len: int, max_seq_len: int) -> int:
    """max_tokens after the context check: prompts that do not fit, or asks beyond it, are 400s."""
    if prompt_len < 1:
        raise APIError("the prompt is empty", param="prompt", code="invalid_value")
    if prompt_len >= max_seq_len:
        raise APIError(
            f"This model's maximum context length is {max_seq_len} tokens, but the prompt has {prompt_len} "
            "tokens (at least one must be left to generate).",
            param="prompt", code="context_length_exceeded",
        )
    room = max_seq_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion).",
            param="max_tokens", code="context_length_exceeded",
        )
    return requested


# ---------------------------------------------------------------------------------------------------------
# Responses (plain dicts)
# ---------------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish: Optional[str]) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def chat_chunk(
    rid: str, created: int, model: str, text: Optional[str], finish: Optional[str], first: bool = False
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict, spec: dict) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use, "speculation": spec}


def full_response(
    kind: str, rid: str, created: int, model: str, text: str, finish: Optional[str], use: dict, spec: dict
) -> dict[str, Any]:
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": use, "speculation": spec}


def models_list(model: str, created: int, max_seq_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "specserve",
         "max_model_len": max_seq_len},
    ]}


def now() -> int:
    return int(time.time())
