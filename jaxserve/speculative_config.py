"""`SpeculativeConfig`: vLLM's `--speculative-config`, parsed from its JSON (command line) or dict (`LLM(...)`) form.

Two methods, as vLLM spells them:

- `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}`: drafts are
  the k tokens that followed the latest earlier occurrence of the sequence's last n..m tokens (prompt lookup);
- `{"model": DRAFT_PATH, "num_speculative_tokens": k}`: a smaller draft model proposes them.

Imports no JAX: the command line parses it before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.errors import ConfigError

NGRAM_METHOD = "ngram"
DRAFT_MODEL_METHOD = "draft_model"
# Most drafts per sequence and step: the verify step computes logits for k + 1 tokens of every sequence row, so k
# multiplies the sampler's work; vLLM's deployment guides use 1 to 5.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's prompt-lookup defaults when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many a sequence may bring to one step."""

    method: str  # NGRAM_METHOD or DRAFT_MODEL_METHOD
    num_speculative_tokens: int  # k: most drafts one sequence brings to a step
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # ngram: longest suffix looked up earlier in the sequence
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # ngram: shortest suffix that may still propose drafts
    model: str | None = None  # draft_model: the draft's folder (HF or Orbax), sharing the target's tokenizer

    @classmethod
    def parse(cls, value: SpeculativeConfig | str | dict | None) -> SpeculativeConfig | None:
        """The config from its JSON text or dict (vLLM's keys); None stays None. Raises ConfigError naming the
        problem: not JSON, an unknown key or method, k out of range, a lookup window that is empty."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config (--speculative-config) is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config (--speculative-config) must be a JSON object, e.g. "
                              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"speculative_config has unknown key {unknown[0]!r} (known: {', '.join(_FIELDS)})")
        return _checked(dict(value))


def _checked(values: dict[str, Any]) -> SpeculativeConfig:
    method = values.get("method") or (DRAFT_MODEL_METHOD if values.get("model") else None)
    if method not in (NGRAM_METHOD, DRAFT_MODEL_METHOD):
        raise ConfigError(f"speculative_config: unknown method {method!r}: use \"ngram\", or give a draft \"model\"")
    k = _positive_int("num_speculative_tokens", values.get("num_speculative_tokens"))
    if k > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                          f"got {k}")
    if method == DRAFT_MODEL_METHOD:
        if not isinstance(values.get("model"), str) or not values["model"]:
            raise ConfigError("speculative_config: the draft_model method needs the draft's folder as \"model\"")
        return SpeculativeConfig(DRAFT_MODEL_METHOD, k, model=values["model"])
    if values.get("model") is not None:
        raise ConfigError("speculative_config: the ngram method takes no \"model\"")
    # vLLM's rule: a missing bound takes the other's value; both missing, both are 5.
    lookup_max = values.get("prompt_lookup_max", values.get("prompt_lookup_min", DEFAULT_PROMPT_LOOKUP))
    lookup_min = values.get("prompt_lookup_min", values.get("prompt_lookup_max", DEFAULT_PROMPT_LOOKUP))
    lookup_max = _positive_int("prompt_lookup_max", lookup_max)
    lookup_min = _positive_int("prompt_lookup_min", lookup_min)
    if lookup_min > lookup_max:
        raise ConfigError(f"speculative_config: prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max "
                          f"({lookup_max})")
    return SpeculativeConfig(NGRAM_METHOD, k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min)


def _positive_int(name: str, value: Any) -> int:
    if value is None:
        raise ConfigError(f"speculative_config: {name} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    return value
