"""The Quart application: the routes' blueprints, auth, admission and slow-client wrappers, the engine's lifetime."""

from __future__ import annotations

from quart import Quart, request

from jaxserve.server import chat, completions, embeddings, lora_routes, ops, responses, tokenizer_routes
from jaxserve.server.admission import releasing_admissions
from jaxserve.server.api_errors import ApiError, register_error_handlers
from jaxserve.server.api_keys import bearer_token, remember_key
from jaxserve.server.config import ServerConfig
from jaxserve.server.context import ServerContext, server_context
from jaxserve.server.slow_clients import dropping_slow_clients

OPEN_PATHS = ("/health", "/version")  # answered without the API key: liveness probes and version checks


def create_app(context: ServerContext) -> Quart:
    app = Quart("jaxserve", static_folder=None)  # an API: no /static route
    app.asgi_app = releasing_admissions(dropping_slow_clients(app.asgi_app, context.config.stream_timeout_s),
                                        context.admission)
    # Streams may run for minutes: Quart's 60 s response timeout would cut them (it looks like a disconnect).
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=context.config.max_body_bytes)
    app.extensions["jaxserve"] = context
    register_error_handlers(app)
    app.before_request(_check_api_key)
    app.before_request(embeddings.refuse_generation_on_pooling_server)
    app.before_serving(_start_engine)
    app.after_serving(_stop_engine)
    app.after_serving(_stop_workers)
    for routes in (completions, chat, responses, embeddings, tokenizer_routes, lora_routes, ops):
        app.register_blueprint(routes.blueprint)
    return app


async def _check_api_key() -> None:
    context = server_context()
    if context.api_keys is None or not _needs_key(request.path, context.config):
        return
    key = context.api_keys.authenticate(bearer_token(request.headers.get("Authorization", "")))
    if key is None:
        raise ApiError(401, "missing or invalid API key (send Authorization: Bearer KEY)", kind="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    remember_key(request.scope, key)  # admission takes the request's share of this key's quota


def _needs_key(path: str, config: ServerConfig) -> bool:
    """Everything but the probes' routes: /health, /version, and /metrics unless --metrics-need-key (scrapers
    often cannot send a key)."""
    return path not in OPEN_PATHS and (path != "/metrics" or config.metrics_need_key)


async def _start_engine() -> None:
    server_context().engine.start()


async def _stop_engine() -> None:
    await server_context().engine.stop()


async def _stop_workers() -> None:
    server_context().workers.shutdown(wait=False, cancel_futures=True)
