"""What every route handler may use: the app's `ServerContext`, and the request helpers every route shares (its body,
the model it names). Routes, admission and the app import this module; it imports none of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from quart import current_app, request

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.prompt_checks import check_text_bytes
from jaxserve.errors import ConfigError
from jaxserve.server.admission import Admission
from jaxserve.server.api_errors import ApiError
from jaxserve.server.api_keys import ApiKeys, api_keys_from_config
from jaxserve.server.api_keys_file import load_api_keys_file
from jaxserve.server.config import ServerConfig
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.served_models import ServedAdapters, ServedModel
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")
WORKER_THREADS = 4  # requests parsed and tokenized at once; more wait their turn off the loop


@dataclasses.dataclass
class ServerContext:
    """What every handler may use; one per app, no module globals."""

    engine: AsyncEngine  # the engine thread's asyncio face
    tokenizer: Tokenizer  # the served model's tokenizer
    config: ServerConfig  # HTTP-side settings and limits
    max_model_len: int  # longest prompt + output
    vocab_size: int  # token ids must be below it
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
        self.metrics = ServerMetrics(lambda: engine.stats, engine.startup_stats)
        self.admission = Admission(engine.config.max_num_seqs + self.config.max_waiting_requests, self.metrics)
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

    async def reload_api_keys(self) -> bool:
        """Reads --api-keys-file again (SIGHUP) and swaps the keys in; a bad file is logged and the old keys stay.

        The file is read and checked on a worker thread; the swap happens on the event loop, between two requests'
        checks, so no request sees half of each file.
        """
        path = self.config.api_keys_file
        if path is None or self.api_keys is None:
            return False
        try:
            specs = await self.off_loop(load_api_keys_file, path)
        except ConfigError as e:
            log.error("SIGHUP: kept the previous API keys, the new file is refused: %s", e)
            return False
        self.api_keys.replace(specs)
        self.metrics.declare_api_keys(self.api_keys.names)
        log.info("SIGHUP: reloaded %d API keys from %s", len(specs), path)
        return True


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
