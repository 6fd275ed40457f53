"""Server-sent events: the one wrapper that turns an async iterator of JSON events into an SSE body.

Every stream ends with `data: [DONE]`, also after an error (sent as an `{"error": ...}` event, which is what
OpenAI's clients raise on). Event ids are `"{request_id}:{index}"`: a client that reconnects sends the last
one back as `Last-Event-ID` and receives the events after it (see ingress).
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Optional

from deployments.protocol import APIError

logger = logging.getLogger("ray.serve." + __name__)  # Serve's replica logger: its file, level and request ids

DONE = "data: [DONE]\n\n"


def format_event(data: Any, event_id: Optional[str] = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {payload}\n\n"


def event_id(request_id: str, index: int) -> str:
    return f"{request_id}:{index}"


def parse_event_id(value: str) -> tuple[str, int]:
    """`"{request_id}:{index}"` -> (request_id, index). A bare request id means "from the start" (-1)."""
    value = value.strip()
    rid, sep, idx = value.rpartition(":")
    if not sep:
        return value, -1
    try:
        return rid, int(idx)
    except ValueError:
        raise APIError(f"malformed Last-Event-ID {value!r}", param="Last-Event-ID", code="invalid_value") from None


async def sse_stream(events: AsyncIterator[tuple[Optional[str], Any]]) -> AsyncIterator[str]:
    """Wrap (event_id, json-able data) pairs into SSE text, ending with [DONE] whatever happens.

    Cancellation (client gone) is not caught: it propagates into `events` so upstream work stops.
    """
    try:
        async for eid, data in events:
            yield format_event(data, eid)
    except APIError as err:
        yield format_event(err.body())
    except Exception as err:  # noqa: BLE001 - the stream must end well-formed; the cause is logged
        logger.exception("stream failed")
        yield format_event(APIError(f"internal error: {type(err).__name__}: {err}", 500,
                                    type="internal_error", code="internal_error").body())
    yield DONE
