"""Admission control: beyond what the engine can run plus a bounded queue, requests are answered 503 at once.

A request is counted from its admission until its HTTP exchange ends (the last byte sent, or the client gone), by an
ASGI wrapper around the app. Counting the engine's live requests instead would let a burst through: the engine learns
of a request a loop turn or more after its admission, and the other handlers of a burst are admitted meanwhile.

With API keys, admission also takes the request's share of its key's quota (quotas.py): over a limit is a 429 with
Retry-After, checked before the server's capacity (a key over its quota learns so whatever the load). The same
wrapper gives the share back when the exchange ends, however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING

from quart import request

from jaxserve.server.api_errors import ApiError
from jaxserve.server.api_keys import authenticated_key
from jaxserve.server.quotas import QuotaExceeded, QuotaTicket, QuotaTooSmall, TokenTally

if TYPE_CHECKING:
    from jaxserve.server.metrics import ServerMetrics

_SCOPE_KEY = "jaxserve.admitted"  # in the ASGI scope: what this exchange holds (_Held), released when it ends
OVERLOADED_RETRY_AFTER_S = 1  # the queue moves at the engine's pace: a second frees room for most requests
DRAINING_RETRY_AFTER_S = 5  # this server is going away; a restarted one (or another replica) will answer


class Admission:
    """The sequences (prompts × n) of admitted requests whose exchange is not over, against a fixed capacity."""

    def __init__(self, capacity: int, metrics: ServerMetrics):
        self.capacity = capacity  # max_num_seqs + max_waiting_requests
        self.metrics = metrics  # where refusals, admissions and each key's tokens are counted
        self.draining = False  # set by SIGTERM: new requests get 503 while in-flight ones finish
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


@dataclasses.dataclass(frozen=True)
class _Held:
    """What an admitted exchange holds until it ends."""

    num_sequences: int  # counted against the server's capacity
    ticket: QuotaTicket | None  # its share of its key's quota; None on a server without API keys


def admit(admission: Admission, num_sequences: int, prompt_tokens: int, max_tokens: int) -> TokenTally:
    """Call before submitting a request's `num_sequences` (prompts × n) sequences of `prompt_tokens` prompt tokens
    in all, each generating up to `max_tokens`; raises the 503, 429 (or 400) to answer. Returns the tally the
    request's tokens are counted into as they are generated (its key's quota is settled with it).

    While draining, every request is refused; a request larger than the whole capacity could never run and is a 400.
    """
    if admission.draining:
        _reject(admission, "draining", "the server is shutting down", DRAINING_RETRY_AFTER_S)
    if num_sequences > admission.capacity:
        raise ApiError(400, f"the request needs {num_sequences} sequences (prompts × n); this server admits at most "
                            f"{admission.capacity} at once", param="n")
    tally = TokenTally(prompt=prompt_tokens)
    ticket = _take_quota(admission, prompt_tokens + max_tokens * num_sequences, tally)
    if not admission.try_admit(num_sequences):
        if ticket is not None:
            ticket.cancel()
        _reject(admission, "overloaded", f"the server is at capacity ({admission.capacity} sequences running or "
                                       "queued); retry later", OVERLOADED_RETRY_AFTER_S)
    if ticket is not None:
        admission.metrics.count_key_admitted(ticket.quota.name)
    request.scope[_SCOPE_KEY] = _Held(num_sequences, ticket)
    return tally


def _take_quota(admission: Admission, reserved_tokens: int, tally: TokenTally) -> QuotaTicket | None:
    """The request's share of its key's quota; None on a server without keys. Over quota: 429 with Retry-After."""
    key = authenticated_key(request.scope)
    if key is None:
        return None
    try:
        return key.try_take(reserved_tokens, tally)
    except QuotaTooSmall as e:
        raise ApiError(400, str(e), param="max_tokens") from None
    except QuotaExceeded as e:
        admission.metrics.count_key_rate_limited(key.name, e.limit)
        # OpenAI's own 429 body: type names what ran out, code is rate_limit_exceeded (openai.RateLimitError).
        kind = "tokens" if e.limit == "tokens_per_minute" else "requests"
        raise ApiError(429, str(e), kind=kind, code="rate_limit_exceeded",
                       headers={"Retry-After": str(e.retry_after_s)}) from None


def _reject(admission: Admission, reason: str, message: str, retry_after_s: int) -> None:
    admission.metrics.count_rejected(reason)
    raise ApiError(503, message, kind="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def releasing_admissions(asgi_app, admission: Admission):
    """Wraps the app's ASGI callable: whatever an exchange was admitted for (server capacity, its key's quota) is
    released when the exchange ends, however it ends (response sent, client gone or dropped, a failure, the server
    cancelling it)."""

    async def app(scope, receive, send) -> None:
        try:
            await asgi_app(scope, receive, send)
        finally:
            held = scope.pop(_SCOPE_KEY, None)
            if held is not None:
                _release(admission, held)

    return app


def _release(admission: Admission, held: _Held) -> None:
    admission.release(held.num_sequences)
    ticket = held.ticket
    if ticket is not None:
        ticket.settle()
        admission.metrics.count_key_tokens(ticket.quota.name, ticket.tally.prompt, ticket.tally.generated)
