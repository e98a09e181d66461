"""The /v1/embeddings answer: declared (what /openapi.json promises; the tests validate answers against it) and
built from the engine's pooled outputs, as OpenAI's (plus vLLM's `id` and `created`)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Literal

import numpy as np

from jaxserve.openai.answers import Answer
from jaxserve.openai.embeddings_requests import BASE64
from jaxserve.outputs import PoolingRequestOutput

LITTLE_ENDIAN_FLOAT32 = np.dtype("<f4")  # what OpenAI's base64 embeddings hold, and the openai client decodes


class Embedding(Answer):
    object: Literal["embedding"]
    index: int  # the input's place in the request's input list
    embedding: list[float] | str  # the vector, or with encoding_format base64 its little-endian float32 bytes


class EmbeddingUsage(Answer):
    prompt_tokens: int  # tokens of every input, as embedded (after truncate_prompt_tokens)
    total_tokens: int  # the same: nothing is generated


class EmbeddingResponse(Answer):
    """POST /v1/embeddings."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def embedding_body(outputs: Sequence[PoolingRequestOutput], model: str, encoding_format: str) -> dict:
    """The answer to a request whose inputs gave `outputs`, in input order."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": index, "embedding": encoded(output.outputs.data, encoding_format)}
                     for index, output in enumerate(outputs)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:  # vector f32[hidden]
    """A vector as numbers, or as base64 of its little-endian float32 bytes."""
    if encoding_format == BASE64:
        return base64.b64encode(np.asarray(vector, LITTLE_ENDIAN_FLOAT32).tobytes()).decode("ascii")
    return np.asarray(vector, np.float32).tolist()
