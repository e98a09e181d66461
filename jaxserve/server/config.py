"""`ServerConfig`: what the HTTP layer needs beyond the engine's settings; flags named as in vLLM."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.errors import ConfigError
from jaxserve.openai.reasoning import REASONING_FORMATS
from jaxserve.openai.tool_call_formats import TOOL_CALL_FORMATS

METRICS_PREFIXES = ("jaxserve", "vllm")  # how /metrics may name its series (server/metrics.py)
TOOL_CALL_PARSERS = tuple(TOOL_CALL_FORMATS)  # vLLM's --tool-call-parser names this server reads
REASONING_PARSERS = tuple(REASONING_FORMATS)  # vLLM's --reasoning-parser names this server reads


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Address, identity, limits and shutdown behaviour of the server; validated on creation."""

    host: str = "127.0.0.1"  # loopback unless told otherwise: an open port is the operator's decision
    port: int = 8000  # TCP port; 0 picks a free one (tests)
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on every route but /health, /version, /metrics
    # Named keys with per-key limits (server/api_keys_file.py), reread on SIGHUP; excludes api_key
    api_keys_file: Path | None = None
    served_model_names: tuple[str, ...] = ("jaxserve-builtin",)  # ids /v1/models lists and requests may name;
    # answers carry the first
    max_waiting_requests: int = 256  # requests queued beyond the running batch; more are answered 503 at once
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    drain_timeout_s: float = 30.0  # after SIGTERM, how long in-flight requests may take to finish
    health_timeout_s: float = 30.0  # /health fails if the engine thread does not answer within this
    # A response send (a stream's chunk) still waiting on the client after this long drops the client and aborts
    # its request: long enough for a network hiccup, short enough that a dead reader frees its slot soon
    stream_timeout_s: float = 60.0
    profile_dir: Path | None = None  # where /start_profile writes JAX profiler traces; None disables the routes
    metrics_need_key: bool = False  # /metrics asks for the API key too (it stays open by default, for scrapers)
    # /metrics names its series jaxserve:*, or vllm:* with vLLM's names, labels and buckets for the series vLLM has
    # too, so that vLLM's dashboards, alerts, autoscalers and endpoint pickers read this server unchanged
    metrics_prefix: str = "jaxserve"
    allow_unknown_fields: bool = False  # drop request fields no one declared instead of answering 400
    # (name, folder) of each LoRA adapter to serve from the start (--lora-modules); needs the engine's enable_lora
    lora_modules: tuple[tuple[str, str], ...] = ()
    tool_call_parser: str = "llama3_json"  # how answers' tool calls are written (one of TOOL_CALL_PARSERS)
    # How answers' reasoning is written (one of REASONING_PARSERS): it comes back as reasoning_content and output
    # constraints apply after it; None: answers are content alone
    reasoning_parser: str | None = None

    @property
    def served_model_name(self) -> str:
        """The name answers carry (vLLM's first --served-model-name)."""
        return self.served_model_names[0]

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting_requests", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_waiting_requests" else 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not self.served_model_names or not all(self.served_model_names):
            raise ConfigError("served_model_names must hold at least one non-empty name")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ConfigError(f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}, "
                              f"got {self.metrics_prefix!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty")
        if self.api_key is not None and self.api_keys_file is not None:
            raise ConfigError("api_key and api_keys_file exclude each other: list every key in the file (a key "
                              "with no limits is a key with only `name` and `key`)")
        names = [name for name, _ in self.lora_modules]
        clashes = sorted(set(n for n in names if names.count(n) > 1 or n in self.served_model_names))
        if clashes:
            raise ConfigError(f"LoRA module name {clashes[0]!r} is given twice or names the served model")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be at least 0, got {self.drain_timeout_s!r}")
        for name in ("health_timeout_s", "stream_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry, in either of vLLM's forms: `name=path`, or JSON `{"name": ..., "path": ...}` (with
    an optional `base_model_name`, which is not checked)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules entry {text!r} is not valid JSON: {e}") from None
        unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else set()
        if not isinstance(entry, dict) or unknown or not all(isinstance(entry.get(k), str) and entry[k]
                                                             for k in ("name", "path")):
            raise ConfigError(f"--lora-modules entry {text!r} must be an object with a non-empty name and path "
                              "(and optionally base_model_name)")
        return entry["name"], entry["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules entry {text!r} must be name=path or a JSON object")
    return name, path
