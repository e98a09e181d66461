"""Routes about the server itself: /health, /metrics, /version, /v1/models, the profiler, /openapi.json."""

from __future__ import annotations

import asyncio
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from quart import Blueprint, Quart, Response, current_app, jsonify
from werkzeug.routing import Rule

from jaxserve.server.api_errors import ApiError
from jaxserve.server.app import ServerContext, server_context

blueprint = Blueprint("ops", __name__)

_NOT_DOCUMENTED = {"HEAD", "OPTIONS"}  # methods every route answers implicitly
_PLACEHOLDER = re.compile(r"<(?:[^<>]*:)?([^<>:]+)>")  # a Werkzeug path variable, converter and all
_ERROR_SCHEMA = {  # OpenAI's error JSON, which every failure is answered with
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "integer", "null"]}}}},
}


@blueprint.get("/health")
async def health() -> Response:
    """200 while the engine thread answers commands; 503 when it is dead or wedged, or while the server drains.

    Draining fails the check on purpose: a load balancer reading it stops sending new requests, which would only get
    503, while the ones in flight finish.
    """
    context = server_context()
    if context.draining:
        raise ApiError(503, "the server is shutting down", kind="service_unavailable")
    await context.engine.check_health(context.config.health_timeout_s)
    return jsonify({"status": "ok"})


@blueprint.get("/metrics")
async def metrics() -> Response:
    """Prometheus metrics: engine queue and KV pages, request latencies, token and request counts."""
    body, content_type = server_context().metrics.exposition()
    return Response(body, content_type=content_type)


@blueprint.get("/version")
async def version() -> Response:
    return jsonify({"version": _version()})


@blueprint.get("/v1/models")
async def list_models() -> Response:
    context = server_context()
    return jsonify({"object": "list", "data": [{
        "id": context.config.served_model_name, "object": "model", "created": context.created, "owned_by": "jaxserve",
        "max_model_len": context.max_model_len}]})


@blueprint.post("/start_profile")
async def start_profile() -> Response:
    """Starts a JAX profiler trace into --profile-dir (TensorBoard / Perfetto); 409 if one is running."""
    context = server_context()
    directory = _profile_dir(context)
    if context.profiling:
        raise ApiError(409, "a profile is already being recorded; POST /stop_profile first", kind="conflict_error")
    context.profiling = True  # before the await: a second start arriving meanwhile must see it
    try:
        await asyncio.to_thread(jax.profiler.start_trace, str(directory))
    except BaseException:
        context.profiling = False
        raise
    return jsonify({"status": "profiling", "profile_dir": str(directory)})


@blueprint.post("/stop_profile")
async def stop_profile() -> Response:
    """Stops the trace and writes it; 409 if none is running."""
    context = server_context()
    directory = _profile_dir(context)
    if not context.profiling:
        raise ApiError(409, "no profile is being recorded; POST /start_profile first", kind="conflict_error")
    # Cleared first: a start arriving while the trace is written waits on JAX's own profiler lock, then begins anew.
    context.profiling = False
    await asyncio.to_thread(jax.profiler.stop_trace)
    return jsonify({"status": "stopped", "profile_dir": str(directory)})


@blueprint.get("/openapi.json")
async def openapi() -> Response:
    """This document: every route of the server, generated from its URL map."""
    return jsonify(openapi_document(current_app))


def openapi_document(app: Quart) -> dict[str, Any]:
    """An OpenAPI 3.1 document with one operation per route and method; request bodies are loose JSON objects."""
    paths: dict[str, dict[str, Any]] = {}
    for rule in app.url_map.iter_rules():
        for method in sorted(rule.methods - _NOT_DOCUMENTED):
            paths.setdefault(openapi_path(rule), {})[method.lower()] = _operation(app, rule, method)
    return {"openapi": "3.1.0", "info": {"title": "jaxserve", "version": _version()}, "paths": paths,
            "components": {"schemas": {"Error": _ERROR_SCHEMA}}}


def openapi_path(rule: Rule) -> str:
    """Werkzeug's `/items/<int:item_id>` as OpenAPI's `/items/{item_id}`."""
    return _PLACEHOLDER.sub(r"{\1}", rule.rule)


def _operation(app: Quart, rule: Rule, method: str) -> dict[str, Any]:
    doc = (app.view_functions[rule.endpoint].__doc__ or "").strip()
    operation: dict[str, Any] = {
        "operationId": f"{rule.endpoint}.{method.lower()}",
        "summary": doc.splitlines()[0] if doc else rule.endpoint,
        "responses": {
            "200": {"description": "success"},
            "default": {"description": "an OpenAI-style error",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
        },
    }
    if rule.arguments:
        operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for name in sorted(rule.arguments)]
    if method in ("POST", "PUT", "PATCH"):
        operation["requestBody"] = {"content": {"application/json": {"schema": {"type": "object"}}}}
    return operation


def _profile_dir(context: ServerContext) -> Path:
    if context.config.profile_dir is None:
        raise ApiError(404, "profiling is off: start the server with --profile-dir DIR", kind="not_found_error")
    return context.config.profile_dir


def _version() -> str:
    return metadata.version("jaxserve")
