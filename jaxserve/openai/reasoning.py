"""Reasoning models' answers: the `<think>...</think>` part apart from the rest, as vLLM's --reasoning-parser reads
it (qwen3, deepseek_r1), streamed or whole alike, and output constraints that apply only after it.

  qwen3        Qwen3 thinks when its answer opens `<think>` (or its prompt left one open, as Qwen3-2507's thinking
               templates do); with `enable_thinking: false` the template closes an empty one in the prompt and the
               whole answer is content
  deepseek_r1  DeepSeek-R1 (and its distills) always think: the answer starts inside the reasoning (its template
               opens `<think>` in the prompt, or the model writes it), up to `</think>`

The reasoning is everything up to `</think>` (a leading `<think>` left out), the content everything after it, exactly
as written. An answer cut off before `</think>` is all reasoning. Tags are matched on text, held back only while the
text could still become one.

With structured output (a JSON Schema, any object, a regex, a choice, or forced tool calls) the grammar lets the
reasoning run free and constrains what follows `</think>`, as vLLM does: `after_reasoning` wraps the constraint's
Lark rules behind a lazy lexeme that ends at the first `</think>`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_outputs import PARAM, StructuredOutputsParams

THINK_START = "<think>"
THINK_END = "</think>"
ANSWER_RULE = "answer"  # the Lark rule of what follows the reasoning
MAX_SPACE_AFTER_REASONING = 4  # whitespace characters a constrained answer may start with after THINK_END
_JSON_WITHOUT_SPACE = {"whitespace_flexible": False}  # as the engine compiles JSON Schemas (no optional whitespace)


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """How one model family writes its reasoning."""

    name: str  # vLLM's --reasoning-parser name
    always_starts_inside: bool  # every answer begins inside the reasoning (else only one that opens THINK_START)


QWEN3 = ReasoningFormat("qwen3", always_starts_inside=False)
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", always_starts_inside=True)
REASONING_FORMATS = {fmt.name: fmt for fmt in (QWEN3, DEEPSEEK_R1)}


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """One request's reasoning: the server's format, and where its answer starts."""

    format: ReasoningFormat  # --reasoning-parser
    starts_inside: bool  # the answer begins inside the reasoning (the format says so, or the prompt opened it)


def reasoning_for_prompt(fmt: ReasoningFormat, prompt_text: str | None) -> Reasoning:
    """The reasoning of an answer to `prompt_text` (the rendered conversation): inside from the start when the
    format always is or the prompt ends with a THINK_START it did not close."""
    text = prompt_text or ""
    opened = text.rfind(THINK_START) > text.rfind(THINK_END)
    return Reasoning(fmt, fmt.always_starts_inside or opened)


@dataclasses.dataclass(frozen=True)
class ReasoningText:
    """Reasoning the answer added."""

    text: str


@dataclasses.dataclass(frozen=True)
class AnswerText:
    """Text after the reasoning (or of an answer without any): content, or tool calls to read."""

    text: str


class ReasoningParser:
    """Splits one answer's text, as it grows, into reasoning and what follows it."""

    def __init__(self, reasoning: Reasoning):
        # opening (a THINK_START may come first), reasoning, answer
        self._state = "opening"
        self._inside = reasoning.starts_inside  # text that does not open THINK_START is still reasoning
        self._pending = ""  # text not yet classified: a tag in the making

    def feed(self, text: str) -> list[ReasoningText | AnswerText]:
        """What `text`, the answer's next piece, adds."""
        pieces: list[ReasoningText | AnswerText] = []
        self._pending += text
        while self._pending and self._READERS[self._state](self, pieces):
            pass
        return pieces

    def finish(self) -> list[ReasoningText | AnswerText]:
        """The answer ended: held-back text is what it was waiting to be told apart from."""
        pending, self._pending = self._pending, ""
        if not pending:
            return []
        reasoning = self._state == "reasoning" or (self._state == "opening" and self._inside)
        return [ReasoningText(pending) if reasoning else AnswerText(pending)]

    def _opening(self, pieces: list) -> bool:
        stripped = self._pending.lstrip()
        if stripped.startswith(THINK_START):
            self._pending, self._state = stripped[len(THINK_START):], "reasoning"
            return True
        if THINK_START.startswith(stripped):  # whitespace, or a THINK_START in the making
            return False
        self._state = "reasoning" if self._inside else "answer"
        return True

    def _reasoning(self, pieces: list) -> bool:
        before, end, after = self._pending.partition(THINK_END)
        if end:
            pieces.extend([ReasoningText(before)] if before else [])
            self._pending, self._state = after, "answer"
            return True
        held = _tag_prefix_length(self._pending, THINK_END)
        shown = self._pending[:len(self._pending) - held]
        pieces.extend([ReasoningText(shown)] if shown else [])
        self._pending = self._pending[len(shown):]
        return False

    def _answer(self, pieces: list) -> bool:
        pieces.append(AnswerText(self._pending))
        self._pending = ""
        return False

    _READERS = {"opening": _opening, "reasoning": _reasoning, "answer": _answer}


def _tag_prefix_length(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag` (0: none)."""
    return next((keep for keep in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-keep:])), 0)


def after_reasoning(reasoning: Reasoning, answer_rules: list[str]) -> StructuredOutputsParams:
    """A grammar of free reasoning up to THINK_END, then the answer `answer_rules` describe (their rule ANSWER_RULE);
    an answer that does not start inside the reasoning may skip it."""
    thought = "reasoning_text" if reasoning.starts_inside else f'({json.dumps(THINK_START)} reasoning_text)?'
    return StructuredOutputsParams(grammar="\n".join([
        f"start: {thought} reasoning_space {ANSWER_RULE}",
        # Lazy: the lexeme ends at the first THINK_END, which the reasoning cannot contain.
        f"reasoning_text[lazy]: /(.|\\n)*{_in_lark_regex(THINK_END)}/",
        # The blank lines models write after THINK_END (Qwen: two newlines), bounded so that a model cannot spend its
        # tokens on whitespace instead of the answer.
        f"reasoning_space: /[ \\t\\r\\n]{{0,{MAX_SPACE_AFTER_REASONING}}}/",
        *answer_rules]))


def constraint_rules(constraint: StructuredOutputsParams, param: str = PARAM) -> list[str]:
    """Lark rules whose ANSWER_RULE is `constraint`'s output; a grammar constraint cannot be nested so and is
    refused, naming the request field `param` that gave it."""
    if constraint.json is not None or constraint.json_object:
        schema: dict[str, Any] = constraint.schema if constraint.json is not None else {"type": "object"}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_JSON_WITHOUT_SPACE, **schema.get("x-guidance", {})}}
        return [f"{ANSWER_RULE}: %json {json.dumps(schema)}"]
    if constraint.regex is not None:
        return [f"{ANSWER_RULE}: /{_in_lark_regex(constraint.regex)}/"]
    if constraint.choice is not None:
        return [f"{ANSWER_RULE}: {' | '.join(json.dumps(choice) for choice in constraint.choice)}"]
    raise InvalidRequestError("a grammar constraint cannot follow a reasoning model's reasoning (the server runs "
                              "with --reasoning-parser): use json, json_object, regex or choice", param=param)


def _in_lark_regex(regex: str) -> str:
    """`regex` inside a Lark /.../ literal: each `/` not already escaped gets its backslash."""
    out, escaped = [], False
    for character in regex:
        out.append("\\/" if character == "/" and not escaped else character)
        escaped = character == "\\" and not escaped
    return "".join(out)
