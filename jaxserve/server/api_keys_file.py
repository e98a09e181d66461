"""--api-keys-file: the keys clients may send, each with a name and optional per-minute and concurrency limits.

    keys:
      - name: team-a               # shown in /metrics and logs; the key itself never is
        key: sk-team-a-4f9c1e
        requests_per_minute: 60    # generation requests admitted per minute
        tokens_per_minute: 100000  # prompt + max_tokens reserved at admission, settled to prompt + generated
        max_concurrent_requests: 8 # generation requests in flight at once
      - name: admin                # no limits
        key: sk-admin-77d0b2

The file is YAML, or JSON (which YAML reads too). Every fault is a ConfigError naming the file, the entry and the
field, and never quoting a key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxserve.errors import ConfigError

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
ENTRY_FIELDS = ("name", "key", *LIMIT_FIELDS)


@dataclasses.dataclass(frozen=True)
class ApiKeySpec:
    """One key of the file, checked."""

    name: str  # unique; labels the key's metrics and log lines
    key: str = dataclasses.field(repr=False)  # the secret sent as `Authorization: Bearer KEY`; kept out of reprs
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # None: no limit
    max_concurrent_requests: int | None = None  # None: no limit


def load_api_keys_file(path: Path) -> tuple[ApiKeySpec, ...]:
    """The file's keys, checked; ConfigError for a missing or unreadable file and for every fault in it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"api keys file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the api keys file {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        # Only the problem and its place: YAML's own message quotes the offending line, which may hold a key.
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML or JSON{where}: {getattr(e, 'problem', None) or 'syntax error'}"
                          ) from None
    return parse_api_keys(data, str(path))


def parse_api_keys(data: Any, source: str) -> tuple[ApiKeySpec, ...]:
    """`{"keys": [entry, ...]}` checked; `source` (the file) starts every error message."""
    if not isinstance(data, dict) or "keys" not in data:
        raise ConfigError(f"{source}: expected a mapping with a `keys` list")
    unknown = sorted(set(data) - {"keys"}, key=str)
    if unknown:
        raise ConfigError(f"{source}: unknown field {unknown[0]!r} (the file holds only `keys`)")
    entries = data["keys"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: `keys` must be a non-empty list of keys")
    specs = tuple(_entry(entry, f"{source}: keys[{index}]") for index, entry in enumerate(entries))
    _check_unique(specs, source)
    return specs


def _entry(entry: Any, where: str) -> ApiKeySpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with `name` and `key`")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: `name` must be a non-empty string")
    where = f"{where} (name {name!r})"
    unknown = sorted(set(entry) - set(ENTRY_FIELDS), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(ENTRY_FIELDS)})")
    key = entry.get("key")
    if not isinstance(key, str):
        raise ConfigError(f"{where}: `key` must be a string (quote it in YAML)")
    if not key:
        raise ConfigError(f"{where}: `key` must not be empty")
    if any(character.isspace() for character in key):
        raise ConfigError(f"{where}: `key` must not contain whitespace (clients send it as a Bearer token)")
    return ApiKeySpec(name=name, key=key, **{field: _limit(entry.get(field), f"{where}: {field}")
                                            for field in LIMIT_FIELDS})


def _limit(value: Any, where: str) -> int | None:
    """A positive integer, or None (the field left out or null) for no limit."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive integer (leave it out for no limit), got {value!r}")
    return value


def _check_unique(specs: tuple[ApiKeySpec, ...], source: str) -> None:
    first_by_name: dict[str, int] = {}
    first_by_key: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if spec.name in first_by_name:
            raise ConfigError(f"{source}: keys[{index}]: duplicate name {spec.name!r} (also "
                              f"keys[{first_by_name[spec.name]}])")
        if spec.key in first_by_key:
            other = specs[first_by_key[spec.key]].name
            raise ConfigError(f"{source}: keys[{index}] (name {spec.name!r}): duplicate key, the same as {other!r}'s")
        first_by_name[spec.name] = index
        first_by_key[spec.key] = index
