"""Server-sent events as OpenAI streams them: `data: JSON` events, closed by `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Response

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> Response:
    response = Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})
    response.timeout = None  # a stream lasts as long as generation does
    return response
