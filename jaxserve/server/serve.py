"""`jaxserve serve`: load the model, start the engine thread, run the app under Hypercorn until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import hypercorn.asyncio
import hypercorn.config

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.llm import LLM
from jaxserve.server.app import ServerContext, create_app
from jaxserve.server.config import ServerConfig
from jaxserve.settings import EngineSettings

log = logging.getLogger(__name__)


def serve(settings: EngineSettings, config: ServerConfig) -> int:
    """Blocks until the server has shut down; returns the process exit code."""
    llm = LLM(**settings.llm_kwargs())
    context = ServerContext(engine=AsyncEngine(llm.engine), tokenizer=llm.tokenizer, config=config,
                            max_model_len=llm.max_model_len, vocab_size=llm.model.config.vocab_size)
    asyncio.run(_serve(context))
    return 0


async def _serve(context: ServerContext) -> None:
    app = create_app(context)
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    await hypercorn.asyncio.serve(app, _hypercorn_config(context.config), shutdown_trigger=shutdown.wait)


def _hypercorn_config(config: ServerConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    hc.bind = [f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"]
    hc.graceful_timeout = config.drain_timeout_s
    hc.errorlog = log
    hc.accesslog = None
    return hc
