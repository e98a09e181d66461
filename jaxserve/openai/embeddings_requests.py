"""The /v1/embeddings request body, declared field by field (schema.py says how): OpenAI's fields and vLLM's
extensions for its pooling runner, each honoured or refused; and the body's inputs and settings for the engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jaxserve.errors import InvalidRequestError
from jaxserve.openai.prompts import TokenizedPrompt, encode_text, is_prompt_list, token_ids_of
from jaxserve.openai.schema import NOT_YET, Body, refused
from jaxserve.pooling_params import PoolingParams
from jaxserve.tokenizer import Tokenizer

INPUT = "input"  # the field every prompt comes from, named by every error about one
FLOAT, BASE64 = "float", "base64"  # encoding_format's values


class EmbeddingRequestBody(Body):
    """POST /v1/embeddings, on a server started with --runner pooling."""

    model: str | None = Field(None, description="the served model's name (--served-model-name); may be left out")
    input: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one embedding each, in order; at most "
        "--max-prompts-per-request, 2048 by default)")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (the default): each embedding a list of numbers; base64: its little-endian float32 "
        "bytes in base64, as OpenAI's (the openai client asks for it)")
    dimensions: int | None = refused("this model's embeddings cannot be shortened: it is not a Matryoshka model")
    user: str | None = Field(None, description="accepted: an end-user id, as OpenAI takes it; changes nothing")
    # vLLM's extensions.
    truncate_prompt_tokens: int | None = Field(
        None, description="keep only this many tokens of each input, the last ones (-1: max_model_len); without it "
        "an input longer than max_model_len is refused")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="with truncate_prompt_tokens: left (the default) keeps the last tokens, right the first")
    add_special_tokens: bool | None = Field(None, description="add BOS to text inputs (default true)")
    use_activation: bool | None = Field(None, description="normalise each embedding to length 1 (default: as the "
                                        "server's pooler, normalised unless --pooler-config says otherwise)")
    normalize: bool | None = Field(None, description="vLLM's older name of use_activation")
    priority: int | None = Field(None, description="scheduling priority, lower served earlier (default 0); other "
                                 "values need --scheduling-policy priority, as in vLLM")
    embed_dtype: str | None = refused("embeddings are float32", "float32")
    endianness: str | None = refused("base64 embeddings are little-endian, as OpenAI's", "native", "little")
    padding: str | None = refused("inputs are never padded", "do_not_pad")
    messages: list[dict[str, Any]] | None = refused("chat-formatted embedding inputs are " + NOT_YET)
    request_id: str | None = refused("the server names its own requests")
    cache_salt: str | None = refused(NOT_YET)
    mm_processor_kwargs: dict[str, Any] | None = refused("the served model reads text only", {})


def pooling_params_from_body(body: EmbeddingRequestBody) -> PoolingParams:
    """The body's per-request settings for the engine (InvalidRequestError naming the field at fault)."""
    return PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens,
                         truncation_side=body.truncation_side or "left", use_activation=body.use_activation,
                         normalize=body.normalize, priority=body.priority or 0)


def embedding_inputs(value: str | list, tokenizer: Tokenizer, add_special_tokens: bool) -> list[TokenizedPrompt]:
    """The `input` field's four forms (text, token ids, a list of either; a list starting with a token id is one
    input), each tokenized; an empty one, or an empty list, is a 400 naming `input`."""
    items = value if is_prompt_list(value) else [value]
    if not items or (isinstance(value, list) and not value):
        raise InvalidRequestError("input is empty: give text, token ids, or a non-empty list of either", param=INPUT)
    prompts = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"input[{index}] is empty text" if len(items) > 1 else "input is empty text",
                                          param=INPUT)
            prompts.append(TokenizedPrompt(item, tuple(encode_text(tokenizer, item, add_special_tokens, INPUT))))
        else:
            prompts.append(TokenizedPrompt(None, token_ids_of(item, INPUT)))
    return prompts
