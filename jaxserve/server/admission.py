"""Admission control: beyond what the engine can run plus a bounded queue, requests are answered 503 at once.

A request is counted from its admission until its HTTP exchange ends (the last byte sent, or the client gone), by an
ASGI wrapper around the app. Counting the engine's live requests instead would let a burst through: the engine learns
of a request a loop turn or more after its admission, and the other handlers of a burst are admitted meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from quart import request

from jaxserve.server.api_errors import ApiError

if TYPE_CHECKING:
    from jaxserve.server.app import ServerContext

_SCOPE_KEY = "jaxserve.admitted_sequences"  # in the ASGI scope: what this exchange holds, released when it ends
OVERLOADED_RETRY_AFTER_S = 1  # the queue moves at the engine's pace: a second frees room for most requests
DRAINING_RETRY_AFTER_S = 5  # this server is going away; a restarted one (or another replica) will answer


class Admission:
    """The sequences (prompts × n) of admitted requests whose exchange is not over, against a fixed capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # max_num_seqs + max_waiting_requests
        self.live = 0  # sequences admitted and not yet released
        self._idle = asyncio.Event()  # set while nothing is admitted
        self._idle.set()

    def try_admit(self, num_sequences: int) -> bool:
        if self.live + num_sequences > self.capacity:
            return False
        self.live += num_sequences
        self._idle.clear()
        return True

    def release(self, num_sequences: int) -> None:
        self.live -= num_sequences
        if self.live == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


def admit(context: ServerContext, num_sequences: int) -> None:
    """Call before submitting a request's `num_sequences` (prompts × n) sequences; raises the 503 (or 400) to answer.

    While draining, every request is refused; a request larger than the whole capacity could never run and is a 400.
    """
    admission = context.admission
    if context.draining:
        _reject(context, "draining", "the server is shutting down", DRAINING_RETRY_AFTER_S)
    if num_sequences > admission.capacity:
        raise ApiError(400, f"the request needs {num_sequences} sequences (prompts × n); this server admits at most "
                            f"{admission.capacity} at once", param="n")
    if not admission.try_admit(num_sequences):
        _reject(context, "overloaded", f"the server is at capacity ({admission.capacity} sequences running or "
                                       "queued); retry later", OVERLOADED_RETRY_AFTER_S)
    request.scope[_SCOPE_KEY] = request.scope.get(_SCOPE_KEY, 0) + num_sequences


def _reject(context: ServerContext, reason: str, message: str, retry_after_s: int) -> None:
    context.metrics.count_rejected(reason)
    raise ApiError(503, message, kind="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def releasing_admissions(asgi_app, admission: Admission):
    """Wraps the app's ASGI callable: whatever an exchange was admitted for is released when the exchange ends,
    however it ends (response sent, client gone, server cancelling it)."""

    async def app(scope, receive, send) -> None:
        try:
            await asgi_app(scope, receive, send)
        finally:
            admission.release(scope.pop(_SCOPE_KEY, 0))

    return app
