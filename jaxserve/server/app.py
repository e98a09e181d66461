"""The Quart application: the shared `ServerContext`, request helpers, auth, and the routes' blueprints."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from quart import Quart, current_app, request

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.prompt_checks import check_text_bytes
from jaxserve.server.admission import Admission, releasing_admissions
from jaxserve.server.api_errors import ApiError, register_error_handlers
from jaxserve.server.api_keys import ApiKeys, api_keys_from_config, bearer_token, remember_key
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.served_models import ServedAdapters, ServedModel
from jaxserve.server.slow_clients import dropping_slow_clients
from jaxserve.tokenizer import Tokenizer

T = TypeVar("T")
OPEN_PATHS = ("/health", "/version")  # answered without the API key: liveness probes and version checks
WORKER_THREADS = 4  # requests parsed and tokenized at once; more wait their turn off the loop


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
    clock: Callable[[], float] = time.monotonic  # the quotas' rate windows run on it (tests pass one they move)
    # The LoRA adapters requests may name (--lora-modules, /v1/load_lora_adapter); empty without --enable-lora
    adapters: ServedAdapters = dataclasses.field(default_factory=ServedAdapters)
    metrics: ServerMetrics = dataclasses.field(init=False)  # this app's Prometheus registry, served by /metrics
    admission: Admission = dataclasses.field(init=False)  # admitted sequences against the engine's batch + queue
    # The keys requests must bring, with their quotas (--api-key or --api-keys-file); None: the server is open
    api_keys: ApiKeys | None = dataclasses.field(init=False)
    # Parsing, tokenizing and detokenizing run here, never on the event loop, so /health answers during them.
    workers: concurrent.futures.ThreadPoolExecutor = dataclasses.field(init=False)

    def __post_init__(self):
        engine = self.engine
        self.metrics = ServerMetrics(lambda: engine.stats)
        self.admission = Admission(engine.engine.config.max_num_seqs + self.config.max_waiting_requests)
        self.api_keys = api_keys_from_config(self.config, self.clock)
        if self.api_keys is not None:
            self.metrics.declare_api_keys(self.api_keys.names)
        self.workers = concurrent.futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="jaxserve-request")

    def check_text_fits(self, texts: Iterable[str], param: str) -> None:
        """Refuses, without tokenizing, prompt text too long for max_model_len tokens (check_text_bytes)."""
        check_text_bytes(sum(len(text.encode("utf-8", "surrogatepass")) for text in texts),
                         longest_token_bytes=self.tokenizer.longest_token_bytes, max_model_len=self.max_model_len,
                         param=param)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on a worker thread: what takes milliseconds or more stays off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(function, *args))


def create_app(context: ServerContext) -> Quart:
    # They import this module for server_context.
    from jaxserve.server import chat, completions, lora_routes, ops, responses, tokenizer_routes

    app = Quart("jaxserve", static_folder=None)  # an API: no /static route
    app.asgi_app = releasing_admissions(dropping_slow_clients(app.asgi_app, context.config.stream_timeout_s),
                                        context)
    # Streams may run for minutes: Quart's 60 s response timeout would cut them (it looks like a disconnect).
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=context.config.max_body_bytes)
    app.extensions["jaxserve"] = context
    register_error_handlers(app)
    app.before_request(_check_api_key)
    app.before_serving(_start_engine)
    app.after_serving(_stop_engine)
    app.after_serving(_stop_workers)
    for routes in (completions, chat, responses, tokenizer_routes, lora_routes, ops):
        app.register_blueprint(routes.blueprint)
    return app


def server_context() -> ServerContext:
    return current_app.extensions["jaxserve"]


async def request_bytes() -> bytes:
    """The request's body, which must be uncompressed UTF-8 JSON (415 otherwise) within --max-body-bytes (413).

    A missing Content-Type is read as JSON, as clients that send bare bodies expect; any other type is refused.
    """
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed")
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise ApiError(415, f"the body must be JSON sent as Content-Type: application/json, got {mimetype!r}")
    charset = request.mimetype_params.get("charset", "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"the body must be UTF-8 JSON, got charset {charset!r}")
    return await request.get_data(as_text=False)


def resolve_model(model: str | None, context: ServerContext) -> ServedModel:
    """Requests must name the served model (or leave it out, as some clients do) or one of its LoRA adapters;
    another name is a 404."""
    names = context.config.served_model_names
    if model is None or model in names:
        return ServedModel(context.config.served_model_name, None)
    lora = context.adapters.get(model)
    if lora is None:
        served = [*names, *(adapter.lora_name for adapter in context.adapters.all())]
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", param="model", kind="not_found_error")
    return ServedModel(model, lora)


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
