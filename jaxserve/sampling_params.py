"""`SamplingParams`: how one request is decoded, named and defaulted as in vLLM so evaluation scripts port over."""

from __future__ import annotations

import contextlib
import dataclasses
import math

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_outputs import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The allowed values of a numeric setting: what SamplingParams checks and what the API's schema declares."""

    low: float  # smallest allowed value
    high: float | None = None  # largest allowed value; None: no upper bound
    low_open: bool = False  # `low` itself is not allowed
    integer: bool = False  # integers only (else any finite number)
    note: str = ""  # what some values mean, for messages

    def holds(self, value) -> bool:
        if not (_is_int(value) if self.integer else _is_number(value)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def spelled(self) -> str:
        """As messages say it: `>= 1 (an integer)`, `in (0, 1] (a number)`."""
        low = f"{self.low:g}"
        if self.high is None:
            interval = f"{'>' if self.low_open else '>='} {low}"
        else:
            interval = f"in {'(' if self.low_open else '['}{low}, {self.high:g}]"
        return f"{interval} ({'an integer' if self.integer else 'a number'}{self.note})"

    def json_schema(self) -> dict[str, float]:
        """The same interval as JSON Schema keywords."""
        keywords = {"exclusiveMinimum" if self.low_open else "minimum": self.low}
        return keywords if self.high is None else {**keywords, "maximum": self.high}


# Every numeric setting's interval, by field name (the API's schema takes them from here).
BOUNDS = {
    "n": Bounds(1, integer=True),
    "max_tokens": Bounds(0, integer=True, note="; 0: score the prompt only"),
    "min_tokens": Bounds(0, integer=True),
    "temperature": Bounds(0),
    "top_p": Bounds(0, 1, low_open=True),
    "top_k": Bounds(-1, integer=True, note="; -1 or 0: disabled"),
    "min_p": Bounds(0, 1),
    "presence_penalty": Bounds(-2, 2),
    "frequency_penalty": Bounds(-2, 2),
    "repetition_penalty": Bounds(0, low_open=True),
    "logprobs": Bounds(0, integer=True, note="; at most the engine's max_logprobs, 20 by default"),
    "prompt_logprobs": Bounds(0, integer=True, note="; at most the engine's max_logprobs, 20 by default"),
}
_OPTIONAL = {"logprobs", "prompt_logprobs"}  # None there means "not asked for"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request, and its scheduling priority; validated on creation."""

    n: int = 1  # continuations per prompt; they share the prompt's KV pages
    max_tokens: int = 16  # most tokens to generate; 0 scores the prompt (prompt_logprobs) and generates none
    min_tokens: int = 0  # EOS and stop token ids are ignored until this many tokens exist
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    seed: int | None = None  # per-request RNG seed, 64 bits, all of them used; same seed, same tokens
    stop: tuple[str, ...] = ()  # strings that end generation; excluded from the text
    stop_token_ids: tuple[int, ...] = ()  # token ids that end generation besides EOS
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # return this many top log-probabilities per token (the sampled one always too)
    prompt_logprobs: int | None = None  # log-probabilities of each prompt token (scoring), plus this many top ones
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this (constrained decoding)
    # vLLM <= 0.10's name for structured_outputs (a GuidedDecodingParams there), keyword only; moved into
    # structured_outputs on creation, so it always reads None.
    guided_decoding: StructuredOutputsParams | None = dataclasses.field(default=None, kw_only=True)
    # Scheduling priority, lower served earlier (vLLM's convention); other than 0 only under --scheduling-policy
    # priority. vLLM passes it beside the params; it rides here because every way in (HTTP, run-batch, offline)
    # already hands the engine one SamplingParams per request, and `priority=` keywords set it (`with_priority`).
    priority: int = 0

    def __post_init__(self):
        # Accept the list forms users write; store tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        bias = self.logit_bias
        bias = bias.items() if isinstance(bias, dict) else _as_tuple(bias, "logit_bias")
        object.__setattr__(self, "logit_bias", tuple(_as_bias_entry(entry) for entry in bias))
        if self.guided_decoding is not None:
            _require(self.structured_outputs is None, "guided_decoding", "guided_decoding is vLLM's older name for "
                     "structured_outputs: give one of them, not both")
            _require(isinstance(self.guided_decoding, StructuredOutputsParams), "guided_decoding",
                     "guided_decoding must be a GuidedDecodingParams")
            object.__setattr__(self, "structured_outputs", self.guided_decoding)
            object.__setattr__(self, "guided_decoding", None)
        self._validate()

    def _validate(self) -> None:
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                _require(bounds.holds(value), name, f"{name} must be {bounds.spelled()}, got {value!r}")
        _require(self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        _require(all(t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
                 "logit_bias maps token ids >= 0 to biases in [-100, 100]")
        _require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
                 f"seed must be a 64-bit integer (from -2**63 to 2**63 - 1), got {self.seed!r}")
        _require(_is_int(self.priority), "priority", f"priority must be an integer, got {self.priority!r}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "stop_token_ids must be non-negative integers")
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, f"{name} must be a boolean, got {value!r}")

    def with_priority(self, priority: int | None) -> SamplingParams:
        """These params with another scheduling priority; None keeps their own (vLLM's `priority=` keywords)."""
        return self if priority is None else dataclasses.replace(self, priority=priority)

    @property
    def greedy(self) -> bool:
        """Whether decoding is deterministic argmax.

        Temperatures below GREEDY_TEMPERATURE count as 0 (as in vLLM): dividing logits by them overflows float32.
        """
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """A repetition, frequency or presence penalty applies: each draw reads every earlier token."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def _as_tuple(values, name: str) -> tuple:
    """The list forms of list fields; null means empty."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise InvalidRequestError(f"{name} must be a list, got {values!r}", param=name)
    return tuple(values)


def _as_bias_entry(entry) -> tuple[int, float]:
    """One (token id, bias) pair; keys arrive as ints offline and as strings from JSON."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise InvalidRequestError(f"logit_bias entries must be (token id, bias) pairs, got {entry!r}",
                                  param="logit_bias")
    token, bias = entry
    if isinstance(token, str):
        with contextlib.suppress(ValueError):
            token = int(token)
    if not _is_int(token):
        raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
    return token, bias


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    # JSON lets NaN and Infinity through, and neither means anything as a sampling setting.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
