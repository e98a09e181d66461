"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added and removed while serving, as vLLM's.

A load reads and checks the folder on the engine thread (between steps) before the name is served: a bad folder is a
400 naming the problem and changes nothing. An unload takes the name away from new requests at once (404 for them);
requests already queued or running with the adapter finish with it. Both need the API key when one is set.
"""

from __future__ import annotations

import asyncio

from quart import Blueprint, Response

from jaxserve.openai.requests import LoadLoraAdapterBody, UnloadLoraAdapterBody
from jaxserve.openai.schema import parse_body
from jaxserve.errors import LoraAdapterError, LoraNameTakenError
from jaxserve.server.api_errors import ApiError
from jaxserve.server.context import ServerContext, request_bytes, server_context
from jaxserve.server.openapi import RouteSchema, declares

blueprint = Blueprint("lora", __name__)


@blueprint.post("/v1/load_lora_adapter")
@declares(RouteSchema(requests=(LoadLoraAdapterBody,), content_type="text/plain"))
async def load_lora_adapter() -> Response:
    context = server_context()
    body = parse_body(LoadLoraAdapterBody, await request_bytes(), context.config.allow_unknown_fields)
    _check_enabled(context)
    if body.lora_name in context.config.served_model_names or context.adapters.is_taken(body.lora_name):
        raise ApiError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded (or names the served "
                            "model); unload it first", param="lora_name")
    lora = context.adapters.reserve(body.lora_name, body.lora_path)
    loading = asyncio.ensure_future(context.engine.add_lora(lora))
    # Settled however the handler ends: a client that leaves mid-load must not leave the engine serving an adapter
    # the server does not know (or the name reserved for good).
    loading.add_done_callback(lambda done: context.adapters.settle(lora, accepted=_succeeded(done)))
    try:
        await asyncio.shield(loading)
    except LoraNameTakenError as e:
        raise ApiError(400, str(e), param="lora_name") from None
    except LoraAdapterError as e:
        raise ApiError(400, str(e), param="lora_path") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", content_type="text/plain")


@blueprint.post("/v1/unload_lora_adapter")
@declares(RouteSchema(requests=(UnloadLoraAdapterBody,), content_type="text/plain"))
async def unload_lora_adapter() -> Response:
    context = server_context()
    body = parse_body(UnloadLoraAdapterBody, await request_bytes(), context.config.allow_unknown_fields)
    _check_enabled(context)
    if context.adapters.remove(body.lora_name) is None:
        raise ApiError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name",
                       kind="not_found_error")
    await context.engine.remove_lora(body.lora_name)
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", content_type="text/plain")


def _succeeded(done: asyncio.Future) -> bool:
    return not done.cancelled() and done.exception() is None


def _check_enabled(context: ServerContext) -> None:
    if not context.engine.config.enable_lora:
        raise ApiError(400, "LoRA adapters are off: start the server with --enable-lora", param="lora_name")
