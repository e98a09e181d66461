"""`jaxserve serve`: load the model, start the engine thread, run the app under Hypercorn until SIGTERM/SIGINT.

In a multi-process group (jaxserve/parallel/process_group.py) every process loads the model the same way; process 0
then serves and schedules, broadcasting each step, while the others only run the steps it broadcasts (no HTTP).

Shutdown drains: the first signal makes every new request a 503 (and /health fail) while the requests in flight
finish, streams included, for at most --drain-timeout seconds; then Hypercorn stops. A second signal cuts the wait.

SIGHUP rereads --api-keys-file (api_keys.reload_api_keys): requests in flight go on and settle with the quota they
took from; a bad file is logged and the keys stay as they were.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import hypercorn.asyncio
import hypercorn.config

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.llm import LLM
from jaxserve.server.app import create_app
from jaxserve.server.context import ServerContext
from jaxserve.server.config import ServerConfig

log = logging.getLogger(__name__)

# Hypercorn's own grace period, after the drain: only connections finishing their last bytes are left by then
# (requests still running at the drain's deadline have been ended), so it need not be long.
_CONNECTION_GRACE_S = 5.0


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Blocks until the server has shut down; returns the process exit code."""
    llm = LLM.from_config(engine_config)
    if llm.is_follower:  # process 0 serves HTTP
        llm.follow_leader()
        return 0
    context = ServerContext(engine=AsyncEngine(llm.engine), tokenizer=llm.tokenizer, config=config,
                            max_model_len=llm.max_model_len, vocab_size=llm.model.config.vocab_size)
    add_lora_modules(context)
    context.tokenizer.longest_token_bytes  # measured once now, not on the first request
    # The millions of objects start-up leaves (JAX, the model, compiled programs) live as long as the server: frozen,
    # the collector stops walking them, so a request that allocates many objects does not stall every other one
    # (/health included) behind a full collection of the whole heap.
    gc.collect()
    gc.freeze()
    asyncio.run(_serve(context))
    llm.release_followers()
    return 0


def add_lora_modules(context: ServerContext) -> None:
    """Reads the --lora-modules adapters before the engine thread starts: a bad folder fails start-up."""
    for name, path in context.config.lora_modules:
        lora = context.adapters.reserve(name, path)
        context.engine.add_lora_before_start(lora)
        context.adapters.settle(lora, accepted=True)


async def _serve(context: ServerContext) -> None:
    app = create_app(context)
    asked, hurried = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, asked, hurried)
    reloads: set[asyncio.Task] = set()  # reloads under way, held so that the loop does not drop them
    if context.config.api_keys_file is not None:
        loop.add_signal_handler(signal.SIGHUP, _start_reload, context, reloads)
    await hypercorn.asyncio.serve(app, _hypercorn_config(context.config),
                                  shutdown_trigger=lambda: _drain(context, asked, hurried))


def _start_reload(context: ServerContext, reloads: set[asyncio.Task]) -> None:
    task = asyncio.ensure_future(context.reload_api_keys())
    reloads.add(task)
    task.add_done_callback(reloads.discard)


def _on_signal(asked: asyncio.Event, hurried: asyncio.Event) -> None:
    """The first signal starts the drain, a second one ends it at once."""
    (hurried if asked.is_set() else asked).set()


async def _drain(context: ServerContext, asked: asyncio.Event, hurried: asyncio.Event) -> None:
    """Hypercorn's shutdown trigger: returns once a signal came and the requests in flight are done (or cut).

    Until it returns Hypercorn keeps accepting connections, so new requests get a 503 rather than a refused
    connection.
    """
    await asked.wait()
    context.admission.draining = True
    log.info("shutting down: new requests get 503; waiting up to %g s for %d in-flight sequences",
             context.config.drain_timeout_s, context.admission.live)
    done = asyncio.ensure_future(_requests_done(context))
    cut = asyncio.ensure_future(hurried.wait())
    await asyncio.wait([done, cut], timeout=context.config.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finished = done.done()
    done.cancel()
    cut.cancel()
    if not finished:
        # Hypercorn would wait for these connections without end (Python 3.12's Server.wait_closed waits for every
        # connection): stopping the engine ends their requests with an error, and so their responses.
        log.warning("drain incomplete: ending %d in-flight sequences", context.admission.live)
        await context.engine.stop()
    log.info("stopping the HTTP server")


async def _requests_done(context: ServerContext) -> None:
    # Admitted exchanges end after their last byte; the engine check also covers a route that skipped admission.
    await context.admission.wait_idle()
    await context.engine.wait_idle()


def _hypercorn_config(config: ServerConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    hc.bind = [f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"]
    hc.graceful_timeout = _CONNECTION_GRACE_S
    hc.errorlog = log
    hc.accesslog = None
    return hc
