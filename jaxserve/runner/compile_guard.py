"""Counting XLA compilations, so that a compile after warm-up is caught (raised or logged) instead of stalling a step.

JAX reports every backend compile through `jax.monitoring`; one listener per process forwards them to whichever
guards are live, so guards (one per engine) come and go without touching JAX's global listener list.
"""

from __future__ import annotations

import logging
import threading
import weakref

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_log = logging.getLogger(__name__)


class CompileAfterWarmupError(RuntimeError):
    """An XLA compilation happened after the engine declared its programs complete."""


class CompileGuard:
    """Counts compiles in its process; after `arm()`, each further compile raises or logs."""

    def __init__(self, raise_on_compile: bool = True):
        self.raise_on_compile = raise_on_compile
        self.total_compiles = 0  # every backend compile seen since this guard was made
        self.compiles_after_warmup = 0  # those seen after arm()
        self._armed = False
        _Dispatcher.instance().add(self)

    def arm(self) -> None:
        """Warm-up is over: from now on every compile is a bug."""
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def on_compile(self, seconds: float) -> None:
        self.total_compiles += 1
        if not self._armed:
            return
        self.compiles_after_warmup += 1
        message = f"XLA compiled a program after warm-up ({seconds:.2f} s): a shape or static argument escaped the buckets"
        if self.raise_on_compile:
            raise CompileAfterWarmupError(message)
        _log.warning(message)


class _Dispatcher:
    """The single jax.monitoring listener, fanning events out to live guards."""

    _instance: _Dispatcher | None = None
    _lock = threading.Lock()

    def __init__(self):
        self._guards: weakref.WeakSet[CompileGuard] = weakref.WeakSet()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    @classmethod
    def instance(cls) -> _Dispatcher:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def add(self, guard: CompileGuard) -> None:
        self._guards.add(guard)

    def _on_event(self, event: str, duration_secs: float, **_) -> None:
        if event == COMPILE_EVENT:
            for guard in list(self._guards):
                guard.on_compile(duration_secs)
