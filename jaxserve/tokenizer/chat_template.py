"""`ChatTemplate`: a model's Jinja chat template, rendered the way transformers renders it.

Templates ship with model folders, so they are untrusted code: they run in Jinja's immutable sandbox, and anything
that goes wrong while compiling or rendering becomes a TokenizerError the server can report as a bad request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

from jaxserve.errors import TokenizerError

Message = Mapping[str, Any]


class ChatTemplate:
    """A compiled chat template; `render` turns a conversation into the prompt text the model was trained on."""

    def __init__(self, source: str, origin: str = "chat template"):
        self.source = source  # the Jinja text, as read from the model folder
        self.origin = origin  # where the text came from, named in every error
        try:
            self._template = _sandboxed_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{origin}: chat template does not compile: {e.message} (line {e.lineno})") from None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render `messages`; `variables` (bos_token, tools, documents, date_string, ...) reach the template as is.

        Keys whose value is None are dropped from each message, as transformers does: OpenAI clients send
        `"content": null` next to tool calls, and templates test for a missing key rather than for None.
        """
        conversation = [_without_none_values(message, index) for index, message in enumerate(_as_list(messages))]
        context = {"tools": None, "documents": None, **variables}
        try:
            return self._template.render(messages=conversation, add_generation_prompt=add_generation_prompt, **context)
        except TokenizerError:
            raise
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.origin}: chat template failed to render: {e}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:
            raise TokenizerError(f"{self.origin}: chat template failed to render: {type(e).__name__}: {e}") from None


def flatten_text_content(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copies of `messages` whose list-of-parts content is joined into one string.

    Many Llama templates concatenate `message['content']` with strings, so they only accept string content. Text
    parts are joined with a newline, as vLLM does; any other part type is rejected since no image or audio input
    is supported.
    """
    flattened = []
    for index, message in enumerate(_as_list(messages)):
        message = dict(_checked_message(message, index))
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(_part_text(part, index) for part in content)
        elif content is not None and not isinstance(content, str):
            raise TokenizerError(f"message {index}: content must be a string or a list of text parts")
        flattened.append(message)
    return flattened


def _as_list(messages: Any) -> list[Any]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TokenizerError("messages must be a list of {role, content} objects")
    return list(messages)


def _checked_message(message: Any, index: int) -> Message:
    if not isinstance(message, Mapping):
        raise TokenizerError(f"message {index} must be an object with a role, found {type(message).__name__}")
    if not isinstance(message.get("role"), str):
        raise TokenizerError(f"message {index}: role must be a string")
    return message


def _without_none_values(message: Any, index: int) -> dict[str, Any]:
    return {key: value for key, value in _checked_message(message, index).items() if value is not None}


def _part_text(part: Any, index: int) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise TokenizerError(f"message {index}: content part of type {kind!r} is not supported, only 'text'")
    text = part.get("text")
    if not isinstance(text, str):
        raise TokenizerError(f"message {index}: a text part needs a string 'text'")
    return text


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation; the message is meant for the user as written."""
    raise TokenizerError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: unlike Jinja's own it neither escapes HTML characters nor sorts keys."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _UnderscoreFreeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot shadow attributes of the object itself.

    Helpers are reached through the class: a Namespace answers attribute lookups on itself from its contents.
    """

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _UnderscoreFreeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _UnderscoreFreeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` and render its body unchanged.

    The tag only marks assistant text for training masks; without it such templates would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _sandboxed_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, so prompts come out byte-identical."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _UnderscoreFreeNamespace
    return environment
