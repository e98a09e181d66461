"""Counting XLA compilations, so that a compile after warm-up is caught (raised or logged) instead of stalling a step.

JAX reports every backend compile through `jax.monitoring`, process-wide. One listener forwards each event to the
guard that is watching in the compiling thread (compiles run in the thread that triggers them), so an engine's
guard sees its own steps' compiles and not those of unrelated JAX code in the same process.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_log = logging.getLogger(__name__)
_watching = threading.local()  # .guard: the CompileGuard watching this thread, if any
_listener_lock = threading.Lock()
_listener_registered = False


class CompileAfterWarmupError(RuntimeError):
    """An XLA compilation happened after the engine declared its programs complete."""


class CompileGuard:
    """Counts compiles inside `watch()`; after `arm()`, each further one raises or logs."""

    def __init__(self, raise_on_compile: bool = True):
        self.raise_on_compile = raise_on_compile
        self.total_compiles = 0  # compiles seen while watching
        self.compiles_after_warmup = 0  # those seen after arm()
        self._armed = False
        _register_listener()

    def arm(self) -> None:
        """Warm-up is over: from now on every compile is a bug."""
        self._armed = True

    @contextlib.contextmanager
    def watch(self):
        """Attributes compiles in this thread to this guard for the duration of the block."""
        outer = getattr(_watching, "guard", None)
        _watching.guard = self
        try:
            yield
        finally:
            _watching.guard = outer

    def on_compile(self, seconds: float) -> None:
        self.total_compiles += 1
        if not self._armed:
            return
        self.compiles_after_warmup += 1
        message = f"XLA compiled a program after warm-up ({seconds:.2f} s): a shape or static argument escaped the buckets"
        if self.raise_on_compile:
            raise CompileAfterWarmupError(message)
        _log.warning(message)


def _register_listener() -> None:
    global _listener_registered
    with _listener_lock:
        if not _listener_registered:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_registered = True


def _on_event(event: str, duration_secs: float, **_) -> None:
    guard = getattr(_watching, "guard", None)
    if event == COMPILE_EVENT and guard is not None:
        guard.on_compile(duration_secs)
