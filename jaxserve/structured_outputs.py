"""`StructuredOutputsParams`: what a request's output must match, named as vLLM names it so offline code ports over.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

Exactly one constraint per request: a JSON Schema, any JSON object, a regular expression, one of a few strings, or
a grammar (Lark, or GBNF/EBNF as llama.cpp writes it). A JSON Schema is checked here against its draft's meta-schema
(jsonschema, the reference validator); whether a constraint can be compiled is checked by the engine's grammar
compiler (engine/structured_output.py), which needs the tokenizer.

vLLM's options beside the constraint are decided as the server decides them (openai/requests.py,
StructuredOutputsBody): those that change nothing here are accepted, the others refused unless they hold the value
that asks for nothing. `GuidedDecodingParams` is vLLM <= 0.10's name for the same thing, with its `backend`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from jaxserve.errors import InvalidRequestError

PARAM = "structured_outputs"  # the SamplingParams field, named in errors
GUIDED_PARAM = "guided_decoding"  # vLLM <= 0.10's name for it, named in GuidedDecodingParams' errors
NOT_YET = "not implemented yet"
BACKENDS = ("auto", "guidance", "llguidance")  # the backends a request may name: all mean llguidance
SCHEMA_CHECK_CACHE_SIZE = 256  # distinct schemas whose meta-schema check is kept (as many as compiled grammars)
_SCHEMA_FAULT_CHARS = 300  # longest jsonschema message quoted (it repeats the offending value)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output; validated on creation."""

    json: str | dict[str, Any] | None = None  # a JSON Schema (a dict, or its JSON text; stored as canonical text)
    json_object: bool = False  # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar, or GBNF/EBNF as llama.cpp writes it
    # vLLM's options (keywords only). They change nothing in the grammar, so they are left out of equality and hash:
    # constraints differing only there share one compiled grammar.
    # Accepted: there is one grammar engine, so nothing to fall back to.
    disable_fallback: bool = dataclasses.field(default=False, kw_only=True, compare=False)
    # Accepted: JSON is generated without optional whitespace anyway.
    disable_any_whitespace: bool = dataclasses.field(default=False, kw_only=True, compare=False)
    # Refused unless False: not implemented yet (objects follow the schema's own additionalProperties).
    disable_additional_properties: bool = dataclasses.field(default=False, kw_only=True, compare=False)
    # Refused unless None: not implemented yet (JSON has no optional whitespace).
    whitespace_pattern: str | None = dataclasses.field(default=None, kw_only=True, compare=False)
    # Refused unless None: not implemented yet (structural tags, which constrain only tagged parts of the output).
    structural_tag: str | None = dataclasses.field(default=None, kw_only=True, compare=False)

    def __post_init__(self):
        self._check_options()
        if self.json is not None:
            if isinstance(self.json, dict):
                text = _canonical_json(self.json)
            elif isinstance(self.json, str):
                text = _canonical_json(_parsed_schema(self.json))
            else:
                raise InvalidRequestError("json must be a JSON Schema: an object, or its JSON text", param=PARAM)
            object.__setattr__(self, "json", text)
            fault = _schema_fault(text)
            if fault is not None:
                raise InvalidRequestError(fault, param=PARAM)
        if self.json_object is None:  # vLLM's default for it
            object.__setattr__(self, "json_object", False)
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"json_object must be a boolean, got {self.json_object!r}", param=PARAM)
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

    def _check_options(self) -> None:
        """vLLM's options, as the server takes them: a boolean (or None, its default) where accepted; refused
        (`<name> is not supported: <reason>`, as the server says it) unless they hold the value that asks for
        nothing."""
        for name in ("disable_fallback", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, False)
            elif not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=PARAM)
        _refuse_unless(self, "disable_additional_properties", (False,), NOT_YET)
        _refuse_unless(self, "whitespace_pattern", (), NOT_YET)
        _refuse_unless(self, "structural_tag", (), NOT_YET)

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


@dataclasses.dataclass(frozen=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM <= 0.10's name for StructuredOutputsParams (`SamplingParams(guided_decoding=...)`), with its two extra
    options. Errors name guided_decoding."""

    # The grammar engine for this request: accepted if None, "auto", "guidance" or "llguidance" (the server's
    # guided_decoding_backend), since the grammar engine is llguidance; any other is refused.
    backend: str | None = dataclasses.field(default=None, kw_only=True, compare=False)
    # Accepted: vLLM sets it itself to allow falling back to another backend; there is one grammar engine.
    backend_was_auto: bool = dataclasses.field(default=False, kw_only=True, compare=False)

    def __post_init__(self):
        try:
            _refuse_unless(self, "backend", BACKENDS, "the grammar engine is llguidance")
            if not isinstance(self.backend_was_auto, bool):
                raise InvalidRequestError(f"backend_was_auto must be a boolean, got {self.backend_was_auto!r}",
                                          param=PARAM)
            super().__post_init__()
        except InvalidRequestError as error:
            raise InvalidRequestError(str(error), param=GUIDED_PARAM) from None


def _refuse_unless(params: StructuredOutputsParams, name: str, neutral: tuple[Any, ...], reason: str) -> None:
    """An option the server refuses (`refused` in openai/schema.py), refused the same way: any value but
    None and `neutral` (values that ask for nothing, of their own type: 0 is not False) is an error naming it."""
    value = getattr(params, name)
    if value is not None and not any(value == ok and type(value) is type(ok) for ok in neutral):
        raise InvalidRequestError(f"{name} is not supported: {reason}", param=PARAM)


def _parsed_schema(text: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {error}", param=PARAM) from None
    except RecursionError:
        raise InvalidRequestError("the JSON schema is nested too deeply", param=PARAM) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("a JSON schema must be an object", param=PARAM)
    return schema


def _canonical_json(schema: Any) -> str:
    """Compact text, keys in their order (outputs follow the order of the schema's properties)."""
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"the JSON schema cannot be written as JSON: {error}", param=PARAM) from None
    except RecursionError:
        raise InvalidRequestError("the JSON schema is nested too deeply", param=PARAM) from None


@functools.lru_cache(maxsize=SCHEMA_CHECK_CACHE_SIZE)
def _schema_fault(text: str) -> str | None:
    """Why the schema (canonical JSON text) breaks its draft's meta-schema, as jsonschema says it; None if it does
    not. The draft is the one `$schema` names (2020-12 if it names none, or none jsonschema knows). Cached by text:
    a large schema takes milliseconds to check, and clients send the same one with every request.

    `format` is not asserted: jsonschema would check the meta-schema's `"format": "regex"` (every `pattern`) with
    Python's `re`, which refuses valid ECMA 262 patterns such as `\\p{L}` or `(?<name>...)`; the grammar engine
    checks patterns in its own dialect when it compiles the schema.
    """
    # Imported here: it takes longer to import than the rest of `import jaxserve`, and only JSON Schemas need it.
    import jsonschema
    from jsonschema.validators import validator_for

    schema = json.loads(text)
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    latest = jsonschema.Draft202012Validator
    try:
        validator = validator_for(schema, default=latest) if isinstance(declared, str) else latest
    except ValueError:  # a `$schema` too malformed to look up (`http://[`): checked as 2020-12, like unknown ones
        validator = latest
    try:
        validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as error:
        message = error.message
        if len(message) > _SCHEMA_FAULT_CHARS:
            message = message[:_SCHEMA_FAULT_CHARS] + "…"
        return f"the JSON schema is not valid: {message} (at {error.json_path})"
    except RecursionError:  # ~100 levels; the grammar engine stops at 128 levels of JSON, about 64 of schema
        return "the JSON schema is nested too deeply"
    return None
