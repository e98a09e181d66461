"""Every failure leaves the server as OpenAI's error JSON with a fitting status: never HTML, never a traceback."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from quart import Quart, Response, jsonify, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge

from jaxserve.openai.bodies import error_body
from jaxserve.errors import EngineDeadError, EngineStepError, InvalidRequestError, JaxserveError, ModelNotFoundError
from jaxserve.server.sse import DONE, sse_event, sse_response

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the server refuses, with the status and OpenAI error fields to answer it."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status  # HTTP status
        self.message = message  # shown to the client: never a secret
        self.param = param  # the request field at fault
        self.kind = kind  # OpenAI's error "type"
        self.headers = headers or {}  # e.g. Retry-After on 503 and 429
        self.code = code  # OpenAI's error "code" (e.g. rate_limit_exceeded on 429); None for most errors


def error_response(error: ApiError) -> Response:
    body = error_body(error.message, error.param, error.kind)
    if error.code is not None:
        body["error"]["code"] = error.code
    response = jsonify(body)
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def as_api_error(error: BaseException) -> ApiError:
    """The ApiError a failure is answered with: bad input 400, engine failures 500/503, anything else 500."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ModelNotFoundError):
        return ApiError(404, str(error), error.param, kind="not_found_error")
    if isinstance(error, InvalidRequestError):
        return ApiError(400, str(error), error.param)
    if isinstance(error, JaxserveError):
        return ApiError(400, str(error))
    if isinstance(error, EngineDeadError):
        return ApiError(503, str(error), kind="service_unavailable", headers={"Retry-After": "5"})
    if isinstance(error, EngineStepError):
        return ApiError(500, str(error), kind="server_error")
    if isinstance(error, MethodNotAllowed):
        allowed = ", ".join(sorted(error.valid_methods or ()))
        return ApiError(405, f"{request.method} is not allowed on {request.path}; it answers {allowed}",
                        headers={"Allow": allowed})
    if isinstance(error, NotFound):
        return ApiError(404, f"no route {request.path} on this server (its routes are listed at /openapi.json)",
                        kind="not_found_error")
    if isinstance(error, RequestEntityTooLarge):
        return ApiError(413, "the request body is larger than the server's --max-body-bytes")
    if isinstance(error, HTTPException):
        return ApiError(error.code or 500, error.description or error.name,
                        kind="invalid_request_error" if (error.code or 500) < 500 else "server_error")
    log.error("unexpected failure while serving a request", exc_info=error)
    return ApiError(500, "internal server error", kind="server_error")


def register_error_handlers(app: Quart) -> None:
    async def handle(error: Exception) -> Response:
        return error_response(as_api_error(error))

    for kind in (ApiError, JaxserveError, EngineDeadError, EngineStepError, HTTPException, Exception):
        app.register_error_handler(kind, handle)


async def streamed_response(payloads: AsyncIterator[dict[str, Any]], preamble: Sequence[dict[str, Any]] = (),
                            ) -> Response:
    """An SSE response: `preamble`, then `payloads`, then `data: [DONE]`.

    The first payload is awaited before answering, so a request the engine refuses still gets its 400; after that
    the status has been sent, and a failure travels as an error event.
    """
    try:
        first = [await anext(payloads)]
    except StopAsyncIteration:
        first = []
    return sse_response(_events([*preamble, *first], payloads))


async def _events(ready: list[dict[str, Any]], rest: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(rest):  # a client that leaves closes `rest`, which aborts its engine requests
        try:
            for payload in ready:
                yield sse_event(payload)
            async for payload in rest:
                yield sse_event(payload)
        except Exception as e:
            error = as_api_error(e)
            yield sse_event(error_body(error.message, error.param, error.kind))
    yield DONE
