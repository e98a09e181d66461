"""Per-key quotas: requests and tokens per minute as token buckets, and requests in flight, on an injected clock.

A per-minute limit L is a bucket holding up to L units, refilled continuously at L a minute: a key may burst up to
its limit, then goes at the limit's pace, and a refused request learns how long until its units are there
(Retry-After). Tokens follow one rule: at admission a request takes from the bucket what it may use at most (its
prompt tokens + max_tokens × its sequences); when its exchange ends, what it did not use (the reservation less its
prompt and generated tokens) goes back. A request whose reservation exceeds the whole limit could never pass: it
is refused for good (400), not told to retry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxserve.server.api_keys_file import ApiKeySpec

SECONDS_PER_MINUTE = 60.0
_SLACK = 1e-9  # float slack: a bucket refilled to exactly the amount asked for lets it through
CONCURRENCY_RETRY_AFTER_S = 1  # a slot frees when one of the key's requests ends: no way to know when


class QuotaExceeded(Exception):
    """The key is over one of its limits now; the request may pass after `retry_after_s`."""

    def __init__(self, message: str, limit: str, retry_after_s: int):
        super().__init__(message)
        self.limit = limit  # the ApiKeySpec field that refused: requests_per_minute, tokens_per_minute, ...
        self.retry_after_s = retry_after_s  # whole seconds until the limit lets the request through (>= 1)


class QuotaTooSmall(Exception):
    """The request alone needs more than the key's whole per-minute limit: retrying cannot help."""


class TokenBucket:
    """A per-minute limit: up to `per_minute` units, refilled continuously at `per_minute` a minute."""

    def __init__(self, per_minute: int, now: float, level: float | None = None):
        self.per_minute = per_minute  # the bucket's size, and its refill per minute
        self._level = float(per_minute) if level is None else min(level, per_minute)  # units at `_updated`
        self._updated = now  # clock reading of `_level`

    def level(self, now: float) -> float:
        refill = (now - self._updated) * self.per_minute / SECONDS_PER_MINUTE
        return min(float(self.per_minute), self._level + refill)

    def wait_s(self, amount: int, now: float) -> float:
        """Seconds until `amount` units are in the bucket; 0 when they are now."""
        missing = amount - self.level(now)
        return 0.0 if missing <= _SLACK else missing * SECONDS_PER_MINUTE / self.per_minute

    def take(self, amount: float, now: float) -> None:
        self._level, self._updated = self.level(now) - amount, now

    def give_back(self, amount: float, now: float) -> None:
        self._level, self._updated = min(float(self.per_minute), self.level(now) + amount), now

    def resized(self, per_minute: int, now: float) -> TokenBucket:
        """The same bucket under a new limit: what it holds is kept, up to the new size."""
        return TokenBucket(per_minute, now, self.level(now))


@dataclasses.dataclass
class TokenTally:
    """Tokens one admitted request has used, counted as its events arrive: its key's quota is settled with them."""

    prompt: int  # every prompt's tokens, each prompt counted once (not once per continuation)
    generated: int = 0  # tokens generated so far over every continuation, an aborted one's included

    @property
    def total(self) -> int:
        return self.prompt + self.generated


class KeyQuota:
    """One key's limits and what its requests hold of them; kept by name across reloads of the keys file."""

    def __init__(self, spec: ApiKeySpec, clock: Callable[[], float]):
        self.name = spec.name  # the key's name: metrics and messages use it, never the key
        self.in_flight = 0  # admitted requests whose exchange has not ended
        self._clock = clock  # monotonic seconds
        self._requests: TokenBucket | None = None  # requests_per_minute; None: no limit
        self._tokens: TokenBucket | None = None  # tokens_per_minute; None: no limit
        self._max_concurrent: int | None = None  # max_concurrent_requests; None: no limit
        self.update(spec)

    def update(self, spec: ApiKeySpec) -> None:
        """New limits (a reloaded file); what requests in flight hold and what the buckets hold is kept."""
        now = self._clock()
        self._requests = _bucket(self._requests, spec.requests_per_minute, now)
        self._tokens = _bucket(self._tokens, spec.tokens_per_minute, now)
        self._max_concurrent = spec.max_concurrent_requests

    def try_take(self, reserved_tokens: int, tally: TokenTally) -> QuotaTicket:
        """Takes a request, its reserved tokens and a concurrency slot, or raises QuotaExceeded (taking nothing).

        QuotaTooSmall when `reserved_tokens` exceed the whole tokens_per_minute limit.
        """
        now = self._clock()
        if self._tokens is not None and reserved_tokens > self._tokens.per_minute:
            raise QuotaTooSmall(f"the request may use {reserved_tokens} tokens (prompt + max_tokens × sequences) but "
                                f"key {self.name!r} allows {self._tokens.per_minute} tokens per minute: lower "
                                "max_tokens")
        self._check_rate(now, reserved_tokens)  # first: its wait is the longer one when both refuse
        self._check_concurrency()
        if self._requests is not None:
            self._requests.take(1, now)
        if self._tokens is not None:
            self._tokens.take(reserved_tokens, now)
        self.in_flight += 1
        return QuotaTicket(self, reserved_tokens, tally)

    def _check_concurrency(self) -> None:
        if self._max_concurrent is not None and self.in_flight >= self._max_concurrent:
            raise QuotaExceeded(f"key {self.name!r} has {self.in_flight} requests in flight, its "
                                f"max_concurrent_requests; retry when one ends", "max_concurrent_requests",
                                CONCURRENCY_RETRY_AFTER_S)

    def _check_rate(self, now: float, reserved_tokens: int) -> None:
        """Refuses with the longer wait of the two buckets: the request needs both."""
        waits = []
        if self._requests is not None:
            waits.append((self._requests.wait_s(1, now), "requests_per_minute",
                          f"{self._requests.per_minute} requests per minute"))
        if self._tokens is not None:
            waits.append((self._tokens.wait_s(reserved_tokens, now), "tokens_per_minute",
                          f"{self._tokens.per_minute} tokens per minute (this request may use {reserved_tokens}: "
                          "prompt + max_tokens × sequences)"))
        wait_s, limit, allowed = max(waits, default=(0.0, "", ""))
        if wait_s > 0:
            retry_after_s = max(1, math.ceil(wait_s - _SLACK))
            raise QuotaExceeded(f"key {self.name!r} is over its limit of {allowed}; retry in {retry_after_s} s",
                                limit, retry_after_s)

    def settle(self, ticket: QuotaTicket) -> None:
        """The request's exchange ended: its slot is freed and the tokens it did not use go back."""
        self.in_flight -= 1
        if self._tokens is not None:
            self._tokens.give_back(max(0, ticket.reserved_tokens - ticket.tally.total), self._clock())

    def cancel(self, ticket: QuotaTicket) -> None:
        """The request was refused after all (the server is full): everything it took goes back."""
        now = self._clock()
        self.in_flight -= 1
        if self._requests is not None:
            self._requests.give_back(1, now)
        if self._tokens is not None:
            self._tokens.give_back(ticket.reserved_tokens, now)


@dataclasses.dataclass
class QuotaTicket:
    """What one admitted request holds of its key's quota until its exchange ends."""

    quota: KeyQuota  # the key's state, kept even if a reload drops the key, so the request settles where it took
    reserved_tokens: int  # taken from tokens_per_minute at admission: prompt + max_tokens × sequences
    tally: TokenTally  # the tokens the request has used so far
    done: bool = False  # settled or cancelled: a second call does nothing

    def settle(self) -> None:
        if not self.done:
            self.done = True
            self.quota.settle(self)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.quota.cancel(self)


def _bucket(bucket: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    """The bucket for a (possibly changed) limit: a new key or a new limit starts full."""
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, now)
    return bucket if bucket.per_minute == per_minute else bucket.resized(per_minute, now)
