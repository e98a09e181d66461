"""How the OpenAI (and vLLM) request bodies are declared and checked: one pydantic model per route.

Every field of OpenAI's and vLLM's completions, chat and responses requests is declared (requests.py,
responses_api_requests.py), so none is ever silently ignored: it is either honoured (the engine does what it asks)
or refused (`refused`: a 400 naming it unless it holds a value that asks for nothing, such as `tools: []` or
`best_of: 1`). A field no one declared is refused too (pydantic's `extra="forbid"`), unless the server runs with
--allow-unknown-fields. Validation is strict (JSON types as they are: `"yes"` is not a boolean, `2.0` not an
integer) and NaN or infinite numbers are refused.

The models check types and shapes; value ranges (temperature >= 0, ...) stay with SamplingParams, which the
offline API shares. The server's /openapi.json and the 400 messages both come from the models; field_table.py
prints the table of every field from them (docs/reference/openai-fields.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import BOUNDS

REFUSED, NEUTRAL = "x-jaxserve-refused", "x-jaxserve-neutral"  # a refused field's schema keys
NOT_YET = "not implemented yet"
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a declared field is refused, and the values that ask for nothing (so they pass)."""

    reason: str  # the 400's explanation
    neutral: tuple[Any, ...]  # values besides null that are accepted and change nothing

    def __call__(self, schema: dict[str, Any]) -> None:
        """The field's JSON Schema says exactly what passes: null or a neutral value."""
        description = schema.get("description")
        schema.clear()
        schema.update({"anyOf": [{"type": "null"}, *({"const": value} for value in self.neutral)], "default": None,
                       "description": description, REFUSED: self.reason, NEUTRAL: list(self.neutral)})


def refused(reason: str, *neutral: Any, description: str = "") -> Any:
    """A declared field that the server does not implement: present with a value other than null or one of
    `neutral` (values that ask for nothing), it is a 400 giving `reason`."""
    return Field(default=None, description=f"refused unless {_spelled(neutral)}: {reason}. {description}".strip(),
                 json_schema_extra=Refusal(reason, neutral))


def refusal_of(field: FieldInfo) -> Refusal | None:
    """The Refusal of a refused field; None for one the server honours."""
    return field.json_schema_extra if isinstance(field.json_schema_extra, Refusal) else None


def bounded(name: str, description: str) -> Any:
    """An optional numeric sampling field, its interval (checked by SamplingParams) declared in the schema."""
    return Field(None, description=description, json_schema_extra=BOUNDS[name].json_schema())


def _spelled(neutral: tuple[Any, ...]) -> str:
    return " or ".join(["null", *(json.dumps(value) for value in neutral)])


class Body(BaseModel):
    """Strict JSON types, finite numbers, no undeclared fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


# The fields that give an output constraint (structured output), on either endpoint
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar"})


def parse_body(model: type[Body], raw: bytes | str | dict, allow_unknown_fields: bool = False,
               max_items: int | None = None) -> Body:
    """`raw` (JSON text, or an already parsed object) as `model`, with every refused field checked; anything wrong
    is an InvalidRequestError naming the field (`param`).

    `max_items` (the model's max_model_len): no list or object of a usable request holds more items (a prompt, a
    message, a tool each cost a token at least), so larger ones are refused before validating them, which would hold
    the interpreter for as long as they are large. Output constraints are exempt: their lists (a schema's enum,
    choices) are the grammar compiler's data, never prompt text, and its time limit bounds them.
    """
    value = raw if isinstance(raw, dict) else parse_json_object(raw)
    if allow_unknown_fields:
        value = {key: item for key, item in value.items() if key in model.model_fields}
    if max_items is not None:
        for name, item in value.items():
            if name not in CONSTRAINT_FIELDS:
                _check_items(name, item, max_items)
    try:
        body = model.model_validate(value)
    except ValidationError as error:
        raise _invalid(model, error) from None
    check_refused(body)
    return body


def check_refused(body: BaseModel) -> None:
    """The first refused field holding a value that asks for something, as a 400 naming it (nested models too)."""
    for name, field in type(body).model_fields.items():
        value = getattr(body, name)
        refusal = refusal_of(field)
        if refusal is not None and value is not None and value not in refusal.neutral:
            raise InvalidRequestError(f"{name} is not supported: {refusal.reason}", param=name)
        for nested in value if isinstance(value, list) else [value]:
            if isinstance(nested, BaseModel):
                try:
                    check_refused(nested)
                except InvalidRequestError as error:
                    raise InvalidRequestError(str(error), param=name) from None


def _check_items(name: str, value: Any, max_items: int) -> None:
    """Refuses field `name` if a list or object inside it is longer than `max_items`; lists of plain values are
    measured, not walked."""
    if isinstance(value, (list, dict)):
        if len(value) > max_items:
            raise InvalidRequestError(f"{name} holds {len(value)} items, more than a request to this model can use "
                                      f"({max_items}, its max_model_len)", param=name)
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, (list, dict)):
                _check_items(name, item, max_items)


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """A request body as a JSON object; not UTF-8, not JSON (too deeply nested included) or not an object is an
    InvalidRequestError."""
    value = _json_value(raw)
    if not isinstance(value, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return value


def _json_value(raw: bytes | str) -> Any:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"the request body is not UTF-8: byte {raw[error.start]:#04x} at position "
                                  f"{error.start}") from None
    try:
        return pydantic_core.from_json(text, allow_inf_nan=True)
    except ValueError as error:
        raise InvalidRequestError(f"the request body is not valid JSON: {error}") from None


def _invalid(model: type[Body], error: ValidationError) -> InvalidRequestError:
    """pydantic's errors as one message and the top-level field at fault."""
    errors = error.errors(include_url=False)
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        # --allow-unknown-fields drops unknown top-level fields only; inside a known field, the path names the key.
        if len(first["loc"]) > 1:
            path = ".".join(str(part) for part in first["loc"])
            return InvalidRequestError(f"unknown field {path!r}: this server does not implement it", param=param)
        return InvalidRequestError(f"unknown field {param!r}: this server does not implement it (an operator can "
                                   "start it with --allow-unknown-fields to drop unknown fields instead)", param=param)
    if first["type"] == "missing" and len(first["loc"]) == 1:
        return InvalidRequestError(f"{param} is required", param=param)
    # Of a union's failed branches, the one that got furthest says the most; if none got inside, the field's
    # description says what it takes.
    branches = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    deepest = max(branches, key=lambda e: len(e["loc"]))
    field = model.model_fields.get(param) if param is not None else None
    if len(branches) > 1 and len(deepest["loc"]) <= 2 and field is not None and field.description:
        return InvalidRequestError(f"{param} must be {field.description}", param=param)
    where = ".".join(str(part) for part in deepest["loc"] if isinstance(part, int) or part.isidentifier())
    return InvalidRequestError(f"{where}: {deepest['msg']}" if where else deepest["msg"], param=param)
