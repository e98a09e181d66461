"""/openapi.json, generated from the app's URL map and the schemas each route declares (`declares`): the request
and response models of openai/ (requests.py, answers.py and their responses_api_* twins), so the document is what the server checks and answers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from importlib import metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from quart import Quart
from werkzeug.routing import Rule

from jaxserve.openai.answers import ErrorResponse

_NOT_DOCUMENTED = {"HEAD", "OPTIONS"}  # methods every route answers implicitly
_PLACEHOLDER = re.compile(r"<(?:[^<>]*:)?([^<>:]+)>")  # a Werkzeug path variable, converter and all
_REF = "#/components/schemas/{model}"


@dataclasses.dataclass(frozen=True)
class RouteSchema:
    """What one route takes and answers."""

    requests: tuple[type[BaseModel], ...] = ()  # its JSON body: one of these models (none: no body)
    response: type[BaseModel] | None = None  # its 200 JSON answer; None: free-form JSON or not JSON
    stream_event: type[BaseModel] | None = None  # with `stream: true`: server-sent events of these, then [DONE]
    content_type: str = "application/json"  # of the 200 answer


def declares(schema: RouteSchema) -> Callable:
    """Marks a view function with its RouteSchema, for the document."""

    def mark(view: Callable) -> Callable:
        view.route_schema = schema
        return view

    return mark


def openapi_document(app: Quart) -> dict[str, Any]:
    """An OpenAPI 3.1 document with one operation per route and method and the declared schemas as components."""
    schemas = {rule.endpoint: getattr(app.view_functions[rule.endpoint], "route_schema", RouteSchema())
               for rule in app.url_map.iter_rules()}
    models = {(m, "validation") for s in schemas.values() for m in s.requests}
    models |= {(m, "serialization") for s in schemas.values() for m in (s.response, s.stream_event) if m is not None}
    models.add((ErrorResponse, "serialization"))
    _, definitions = models_json_schema(sorted(models, key=lambda pair: pair[0].__name__), ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        for method in sorted(rule.methods - _NOT_DOCUMENTED):
            paths.setdefault(openapi_path(rule), {})[method.lower()] = _operation(app, rule, method,
                                                                                  schemas[rule.endpoint])
    return {"openapi": "3.1.0", "info": {"title": "jaxserve", "version": metadata.version("jaxserve")},
            "paths": paths, "components": {"schemas": definitions.get("$defs", {}),
                                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def openapi_path(rule: Rule) -> str:
    """Werkzeug's `/items/<int:item_id>` as OpenAPI's `/items/{item_id}`."""
    return _PLACEHOLDER.sub(r"{\1}", rule.rule)


def _operation(app: Quart, rule: Rule, method: str, schema: RouteSchema) -> dict[str, Any]:
    doc = (app.view_functions[rule.endpoint].__doc__ or "").strip()
    answer: dict[str, Any] = {"description": "success"}
    content = {schema.content_type: {"schema": _ref(schema.response) if schema.response else {}}}
    if schema.stream_event is not None:
        content["text/event-stream"] = {"schema": _sse_event(schema.stream_event)}
    answer["content"] = content
    operation: dict[str, Any] = {
        "operationId": f"{rule.endpoint}.{method.lower()}",
        "summary": doc.splitlines()[0] if doc else rule.endpoint,
        "responses": {"200": answer, "default": {"description": "an OpenAI-style error", "content": {
            "application/json": {"schema": _ref(ErrorResponse)}}}},
    }
    if rule.arguments:
        operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for name in sorted(rule.arguments)]
    if schema.requests:
        refs = [_ref(model) for model in schema.requests]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}
    return operation


def _sse_event(model: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes a stream by its events): `data` is `model` or an error as JSON,
    or the closing `[DONE]`."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(model), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}, "event": {"type": "string"}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}
