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
# Fires, in the compiling thread, when JAX's persistent compilation cache hands back a program (inside a compile
# event: a cache hit still counts as a compile above, since the program was traced, lowered and looked up).
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_log = logging.getLogger(__name__)
_watching = threading.local()  # .guard: the CompileGuard watching this thread; .counts: its CompileCounts, if any
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


class CompileCounts:
    """One thread's compile events within `counting_compiles()`."""

    def __init__(self):
        self.compiles = 0  # programs XLA compiled, or the persistent cache handed back (a compile event each)
        self.cache_hits = 0  # of those, the ones JAX's persistent compilation cache handed back

    @property
    def compiled(self) -> bool:
        """XLA compiled the program: neither the persistent cache nor JAX's in-memory one (no event) handed it back."""
        return self.compiles > 0 and self.cache_hits == 0


@contextlib.contextmanager
def counting_compiles():
    """Counts this thread's compile events for the duration of the block (yields the CompileCounts)."""
    _register_listener()
    counts, outer = CompileCounts(), getattr(_watching, "counts", None)
    _watching.counts = counts
    try:
        yield counts
    finally:
        _watching.counts = outer


def _register_listener() -> None:
    global _listener_registered
    with _listener_lock:
        if not _listener_registered:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            jax.monitoring.register_event_listener(_on_plain_event)
            _listener_registered = True


def _on_event(event: str, duration_secs: float, **_) -> None:
    if event != COMPILE_EVENT:
        return
    counts = getattr(_watching, "counts", None)
    if counts is not None:
        counts.compiles += 1
    guard = getattr(_watching, "guard", None)
    if guard is not None:
        guard.on_compile(duration_secs)


def _on_plain_event(event: str, **_) -> None:
    counts = getattr(_watching, "counts", None)
    if event == CACHE_HIT_EVENT and counts is not None:
        counts.cache_hits += 1
