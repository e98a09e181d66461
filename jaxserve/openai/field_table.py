"""The table of OpenAI request fields, from the declared schemas (requests.py, responses_api_requests.py,
embeddings_requests.py): each field honoured or refused, and why. docs/reference/openai-fields.md is this table
(written by `python -m tools.docs_pages`, whose --check tests/test_docs.py runs); print it with
`.venv/bin/python -m jaxserve.openai.field_table`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from jaxserve.openai.embeddings_requests import EmbeddingRequestBody
from jaxserve.openai.requests import ChatCompletionRequestBody, ChatMessage, CompletionRequestBody
from jaxserve.openai.responses_api_requests import ResponsesFunctionTool, ResponsesMessageItem, ResponsesRequestBody
from jaxserve.openai.schema import refusal_of


def field_status(model: type[BaseModel]) -> dict[str, str]:
    """Each field of `model` and what the server does with it."""
    status = {}
    for name, field in model.model_fields.items():
        refusal = refusal_of(field)
        if refusal is not None:
            allowed = ", ".join(["null", *(json.dumps(value) for value in refusal.neutral)])
            status[name] = f"refused unless {allowed}: {refusal.reason}"
        elif (field.description or "").startswith("accepted"):
            status[name] = field.description
        else:
            status[name] = "honoured" + (f": {field.description}" if field.description else "")
    return status


def markdown() -> str:
    completions, chat = field_status(CompletionRequestBody), field_status(ChatCompletionRequestBody)
    shared = [name for name in completions if chat.get(name) == completions[name]]
    tables = [("`/v1/completions` and `/v1/chat/completions`", {name: completions[name] for name in shared}),
              ("`/v1/completions` only", {n: s for n, s in completions.items() if n not in shared}),
              ("`/v1/chat/completions` only", {n: s for n, s in chat.items() if n not in shared}),
              ("a chat message (`messages[i]`)", field_status(ChatMessage)),
              ("`/v1/responses`", field_status(ResponsesRequestBody)),
              ("a message item of the input (`input[i]`)", field_status(ResponsesMessageItem)),
              ("a function tool (`tools[i]` of `/v1/responses`)", field_status(ResponsesFunctionTool)),
              ("`/v1/embeddings` (`--runner pooling`)", field_status(EmbeddingRequestBody))]
    return "\n\n".join("\n".join([f"| field | {title} |", "|---|---|", *(f"| `{n}` | {s} |" for n, s in rows.items())])
                       for title, rows in tables)


if __name__ == "__main__":
    print(markdown())
