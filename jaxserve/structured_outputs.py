"""`StructuredOutputsParams`: what a request's output must match, named as vLLM names it so offline code ports over.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

Exactly one constraint per request: a JSON Schema, any JSON object, a regular expression, one of a few strings, or
a grammar (Lark, or GBNF/EBNF as llama.cpp writes it). Whether the constraint itself is valid is checked by the
engine's grammar compiler (engine/structured_output.py), which needs the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.errors import InvalidRequestError

PARAM = "structured_outputs"  # the SamplingParams field, named in errors


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; validated on creation."""

    json: str | dict[str, Any] | None = None  # a JSON Schema (a dict, or its JSON text; stored as canonical text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar, or GBNF/EBNF as llama.cpp writes it

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _canonical_json(self.json))
        elif isinstance(self.json, str):
            object.__setattr__(self, "json", _canonical_json(_parsed_schema(self.json)))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("choice must be a list of non-empty strings", param=PARAM)
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise InvalidRequestError("choice must list at least one string", param=PARAM)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", param=PARAM)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(f"structured outputs take exactly one of json, json_object, regex, choice or "
                                      f"grammar; got {', '.join(given) or 'none'}", param=PARAM)

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema as a dict (json only)."""
        return json.loads(self.json) if self.json is not None else None


def _parsed_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {error}", param=PARAM) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("a JSON schema must be an object", param=PARAM)
    return schema


def _canonical_json(schema: Any) -> str:
    """Compact text, keys in their order (outputs follow the order of the schema's properties)."""
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"the JSON schema cannot be written as JSON: {error}", param=PARAM) from None
