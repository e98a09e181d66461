"""Routes about the server itself: /health, /metrics, /version, /v1/models, the profiler, /openapi.json."""

from __future__ import annotations

import asyncio
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from quart import Blueprint, Response, current_app, jsonify

from jaxserve.openai.answers import ModelCard, ModelList
from jaxserve.lora_request import LoRARequest
from jaxserve.server.api_errors import ApiError
from jaxserve.server.context import ServerContext, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares, openapi_document

blueprint = Blueprint("ops", __name__)


@blueprint.get("/health")
async def health() -> Response:
    """200 while the engine thread answers commands; 503 when it is dead or wedged, or while the server drains.

    Draining fails the check on purpose: a load balancer reading it stops sending new requests, which would only get
    503, while the ones in flight finish.
    """
    context = server_context()
    if context.admission.draining:
        raise ApiError(503, "the server is shutting down", kind="service_unavailable")
    await context.engine.check_health(context.config.health_timeout_s)
    return jsonify({"status": "ok"})


@blueprint.get("/metrics")
@declares(RouteSchema(content_type="text/plain"))
async def metrics() -> Response:
    """Prometheus metrics: engine queue and KV pages, request latencies, token and request counts; named `jaxserve:*`,
    or as vLLM names them with --metrics-prefix vllm."""
    context = server_context()
    body, content_type = context.metrics.exposition(context.config.metrics_prefix, context.config.served_model_name)
    return Response(body, content_type=content_type)


@blueprint.get("/version")
async def version() -> Response:
    return jsonify({"version": metadata.version("jaxserve")})


@blueprint.get("/v1/models")
@declares(RouteSchema(response=ModelList))
async def list_models() -> Response:
    """The served model, under each of its names, then its LoRA adapters."""
    context = server_context()
    cards = [_model_card(context, name) for name in context.config.served_model_names]
    cards += [_adapter_card(context, lora) for lora in context.adapters.all()]
    return jsonify({"object": "list", "data": cards})


@blueprint.get("/v1/models/<path:model_id>")
@declares(RouteSchema(response=ModelCard))
async def retrieve_model(model_id: str) -> Response:
    """One model by its id (one of the served model's names or adapters, else 404)."""
    context = server_context()
    served = resolve_model(model_id, context)
    return jsonify(_model_card(context, model_id) if served.lora is None else _adapter_card(context, served.lora))


def _model_card(context: ServerContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": context.created, "owned_by": "jaxserve",
            "root": name, "parent": None, "max_model_len": context.max_model_len}


def _adapter_card(context: ServerContext, lora: LoRARequest) -> dict[str, Any]:
    """As vLLM lists an adapter: its folder as root, the served model as parent."""
    return {**_model_card(context, lora.lora_name), "root": lora.lora_path,
            "parent": context.config.served_model_name}


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
    """This document: every route of the server, generated from its URL map and the routes' declared schemas."""
    return jsonify(openapi_document(current_app))


def _profile_dir(context: ServerContext) -> Path:
    if context.config.profile_dir is None:
        raise ApiError(404, "profiling is off: start the server with --profile-dir DIR", kind="not_found_error")
    return context.config.profile_dir


