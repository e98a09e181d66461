"""The API keys the server accepts and each one's quota; reloaded from --api-keys-file on SIGHUP (ServerContext).

`--api-key KEY` is one key named "default" with no limits; `--api-keys-file` lists named keys with limits (the two
flags exclude each other). A request's key is found in constant time: the SHA-256 of the token it sent is compared
with every key's (hmac.compare_digest, no early exit), so neither which key matched nor how much of a guess was
right shows in the answer's timing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from jaxserve.server.api_keys_file import ApiKeySpec, load_api_keys_file
from jaxserve.server.config import ServerConfig
from jaxserve.server.quotas import KeyQuota

log = logging.getLogger(__name__)

DEFAULT_KEY_NAME = "default"  # the name --api-key's key goes by in /metrics
_SCOPE_KEY = "jaxserve.api_key"  # in the ASGI scope: the KeyQuota of the key the request authenticated with


class ApiKeys:
    """The accepted keys and their quotas, by name; `replace` swaps the keys and keeps the quotas of kept names."""

    def __init__(self, specs: Iterable[ApiKeySpec], clock: Callable[[], float]):
        self._clock = clock  # monotonic seconds, for the quotas' rate windows
        self._quotas: dict[str, KeyQuota] = {}  # by key name
        self._digests: list[tuple[bytes, KeyQuota]] = []  # SHA-256 of each key, and its quota
        self.replace(specs)

    @property
    def names(self) -> list[str]:
        return list(self._quotas)

    def quota(self, name: str) -> KeyQuota:
        return self._quotas[name]

    def authenticate(self, token: str) -> KeyQuota | None:
        """The quota of the key `token` is, or None; every key is compared, whichever matches."""
        digest = _digest(token)
        found = None
        for key_digest, quota in self._digests:
            if hmac.compare_digest(digest, key_digest):
                found = quota
        return found

    def replace(self, specs: Iterable[ApiKeySpec]) -> None:
        """The new keys: a name that stays keeps its quota's state (requests in flight, buckets) under its new
        limits; a dropped name's requests in flight still settle on the quota they took from."""
        quotas: dict[str, KeyQuota] = {}
        digests = []
        for spec in specs:
            quota = self._quotas.get(spec.name)
            if quota is None:
                quota = KeyQuota(spec, self._clock)
            else:
                quota.update(spec)
            quotas[spec.name] = quota
            digests.append((_digest(spec.key), quota))
        self._quotas, self._digests = quotas, digests


def api_keys_from_config(config: ServerConfig, clock: Callable[[], float]) -> ApiKeys | None:
    """The keys the flags give; None when the server is open (no --api-key, no --api-keys-file)."""
    if config.api_keys_file is not None:
        return ApiKeys(load_api_keys_file(config.api_keys_file), clock)
    if config.api_key is not None:
        return ApiKeys([ApiKeySpec(name=DEFAULT_KEY_NAME, key=config.api_key)], clock)
    return None


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer TOKEN` header; "" for any other scheme (no key is empty)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def remember_key(scope: MutableMapping[str, Any], quota: KeyQuota) -> None:
    scope[_SCOPE_KEY] = quota


def authenticated_key(scope: MutableMapping[str, Any]) -> KeyQuota | None:
    """The quota of the key this exchange authenticated with; None on a server without keys."""
    return scope.get(_SCOPE_KEY)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
