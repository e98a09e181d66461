"""Routes about the server itself: /health, /version, /v1/models."""

from __future__ import annotations

from importlib import metadata

from quart import Blueprint, Response, jsonify

from jaxserve.server.app import server_context

blueprint = Blueprint("ops", __name__)


@blueprint.get("/health")
async def health() -> Response:
    """200 only when the engine thread answers a command: a wedged or dead engine fails the check (503)."""
    context = server_context()
    await context.engine.check_health(context.config.health_timeout_s)
    return jsonify({"status": "ok"})


@blueprint.get("/version")
async def version() -> Response:
    return jsonify({"version": metadata.version("jaxserve")})


@blueprint.get("/v1/models")
async def list_models() -> Response:
    context = server_context()
    return jsonify({"object": "list", "data": [{
        "id": context.config.served_model_name, "object": "model", "created": context.created, "owned_by": "jaxserve",
        "max_model_len": context.max_model_len}]})
