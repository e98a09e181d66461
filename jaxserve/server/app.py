"""The Quart application: the shared `ServerContext`, request helpers, auth, and the routes' blueprints."""

from __future__ import annotations

import dataclasses
import hmac
import time
from typing import Any

from quart import Quart, current_app, request

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.admission import Admission, releasing_admissions
from jaxserve.server.api_errors import ApiError, register_error_handlers
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import ServerMetrics
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class ServerContext:
    """What every handler may use; one per app, no module globals."""

    engine: AsyncEngine  # the engine thread's asyncio face
    tokenizer: Tokenizer  # the served model's tokenizer
    config: ServerConfig  # HTTP-side settings and limits
    max_model_len: int  # longest prompt + output
    vocab_size: int  # token ids must be below it
    draining: bool = False  # set by SIGTERM: new requests get 503 while in-flight ones finish
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))  # start time, shown by /v1/models
    profiling: bool = False  # a JAX profiler trace is being recorded (/start_profile until /stop_profile)
    metrics: ServerMetrics = dataclasses.field(init=False)  # this app's Prometheus registry, served by /metrics
    admission: Admission = dataclasses.field(init=False)  # admitted sequences against the engine's batch + queue

    def __post_init__(self):
        engine = self.engine
        self.metrics = ServerMetrics(lambda: engine.stats)
        self.admission = Admission(engine.engine.config.max_num_seqs + self.config.max_waiting_requests)


def create_app(context: ServerContext) -> Quart:
    from jaxserve.server import chat, completions, ops, tokenizer_routes  # they import this module for server_context

    app = Quart("jaxserve", static_folder=None)  # an API: no /static route
    app.asgi_app = releasing_admissions(app.asgi_app, context.admission)
    # Streams may run for minutes: Quart's 60 s response timeout would cut them (it looks like a disconnect).
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=context.config.max_body_bytes)
    app.extensions["jaxserve"] = context
    register_error_handlers(app)
    app.before_request(_check_api_key)
    app.before_serving(_start_engine)
    app.after_serving(_stop_engine)
    for routes in (completions, chat, tokenizer_routes, ops):
        app.register_blueprint(routes.blueprint)
    return app


def server_context() -> ServerContext:
    return current_app.extensions["jaxserve"]


async def json_body() -> dict[str, Any]:
    """The request's JSON object; malformed JSON or another JSON type is a 400 in OpenAI's shape, never HTML."""
    body = await request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], context: ServerContext) -> None:
    """Requests must name the served model (or leave it out, as some clients do); another name is a 404."""
    model = body.get("model")
    if model is not None and model != context.config.served_model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{context.config.served_model_name!r}", param="model", kind="not_found_error")


async def _check_api_key() -> None:
    context = server_context()
    if context.config.api_key is None or not _needs_key(request.path):
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # Constant time: the comparison must not reveal how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), context.config.api_key.encode()):
        raise ApiError(401, "missing or invalid API key (send Authorization: Bearer KEY)", kind="authentication_error")


def _needs_key(path: str) -> bool:
    """The API (as in vLLM) and the profiler, which writes files; health, metrics and tokenizer routes stay open
    for probes, scrapers and harnesses."""
    return path.startswith("/v1/") or path in ("/start_profile", "/stop_profile")


async def _start_engine() -> None:
    server_context().engine.start()


async def _stop_engine() -> None:
    await server_context().engine.stop()
