"""How models write tool calls, one `ToolCallFormat` per vLLM `--tool-call-parser` name:

  llama3_json  Llama 3.1-3.3: `{"name": "f", "parameters": {...}}` (after `<|python_tag|>` or not), several joined
               by "; "; the answer is calls or text, never both
  hermes       Hermes, Qwen2.5, Qwen3: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per
               call; text may come before the first
  mistral      Mistral 7B v0.3 and its kin: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`, one JSON array;
               text may come before it

A format is a few literal pieces around the one thing all of them share, a call object `{"name": ..., <arguments
key>: {...}}`: what opens the first call, what opens each next one, what closes a call. `match_pieces` reads a head
(pieces up to the `{` of the arguments) from text as it streams, saying whether it matched, may still match, or
cannot; whitespace may sit between any two pieces. The same pieces give the Lark grammar that forces calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

NAME = object()  # the function-name slot of a head: letters, digits, _ and -, at most 64
_NAME_CHARS = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_NAME = 64
Piece = str | tuple[str, ...] | object  # a literal, alternatives (one may be "": optional), or NAME


def _call_pieces(arguments_keys: tuple[str, ...]) -> tuple[Piece, ...]:
    """A call object up to the `{` that opens its arguments."""
    return ("{", '"name"', ":", '"', NAME, '"', ",", tuple(f'"{key}"' for key in arguments_keys), ":", "{")


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call syntax."""

    name: str  # vLLM's --tool-call-parser name
    first_head: tuple[Piece, ...]  # pieces from the start of the calls to the `{` of the first call's arguments
    next_head: tuple[Piece, ...]  # pieces from a closed call to the `{` of the next call's arguments
    call_close: tuple[str, ...]  # pieces after a call's arguments object that close the call
    trigger: str | None  # where calls begin when text may precede them; None: the answer starts with its calls
    arguments_key: str  # the key a forced call's arguments go under
    # Lark pieces of forced calls: before the first, between two, after the last (text the model writes as is)
    forced_open: str
    forced_separator: str
    forced_end: str
    keeps_special_tokens: bool = False  # the trigger is a special token: answers are detokenized with it kept

    def forced_calls_rules(self, entry: str, alternatives: Sequence[str], parallel: bool) -> list[str]:
        """Lark rules: `entry`, the calls (one, or with `parallel` one or more) in this format, each one of the
        rules named in `alternatives`."""
        more = f"({_lark_literal(self.forced_separator)} call)*" if parallel else ""
        pieces = [_lark_literal(self.forced_open), "call", more, _lark_literal(self.forced_end)]
        return [f"{entry}: {' '.join(piece for piece in pieces if piece)}", f"call: {' | '.join(alternatives)}"]


LLAMA3_JSON = ToolCallFormat(
    name="llama3_json", first_head=(("<|python_tag|>", ""), *_call_pieces(("parameters", "arguments"))),
    next_head=(";", *_call_pieces(("parameters", "arguments"))), call_close=("}",), trigger=None,
    arguments_key="parameters", forced_open="", forced_separator="; ", forced_end="")
HERMES = ToolCallFormat(
    name="hermes", first_head=("<tool_call>", *_call_pieces(("arguments",))),
    next_head=("<tool_call>", *_call_pieces(("arguments",))), call_close=("}", "</tool_call>"),
    trigger="<tool_call>", arguments_key="arguments", forced_open="<tool_call>\n",
    forced_separator="\n</tool_call>\n<tool_call>\n", forced_end="\n</tool_call>")
MISTRAL = ToolCallFormat(
    name="mistral", first_head=("[TOOL_CALLS]", "[", *_call_pieces(("arguments",))),
    next_head=(",", *_call_pieces(("arguments",))), call_close=("}",), trigger="[TOOL_CALLS]",
    arguments_key="arguments", forced_open="[TOOL_CALLS] [", forced_separator=", ", forced_end="]",
    keeps_special_tokens=True)
TOOL_CALL_FORMATS = {fmt.name: fmt for fmt in (LLAMA3_JSON, HERMES, MISTRAL)}


@dataclasses.dataclass(frozen=True)
class HeadMatch:
    """What `match_pieces` found at the start of some text."""

    status: str  # "match", "maybe" (the text so far is a prefix of a match) or "no"
    name: str | None = None  # with a match: the function named (when the pieces have a NAME slot)
    end: int = 0  # with a match: where the matched text ends


def match_pieces(text: str, pieces: Sequence[Piece]) -> HeadMatch:
    """Whether `text` starts with the pieces, whitespace allowed before each one."""
    position, name = 0, None
    for piece in pieces:
        position = _skip_space(text, position)
        if piece is NAME:
            found = _NAME_CHARS.match(text, position)
            if found is None:
                return HeadMatch("maybe" if position == len(text) else "no")
            if found.end() == len(text):
                return HeadMatch("maybe" if found.end() - position < MAX_NAME else "no")
            name, position = found.group(), found.end()
            continue
        options = piece if isinstance(piece, tuple) else (piece,)
        rest = text[position:]
        taken = next((option for option in options if option and rest.startswith(option)), None)
        if taken is not None:
            position += len(taken)
        elif any(option.startswith(rest) for option in options if option):
            return HeadMatch("maybe")
        elif "" not in options:
            return HeadMatch("no")
    return HeadMatch("match", name, position)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def trigger_split(text: str, trigger: str) -> tuple[str, str | None]:
    """(text before the trigger, the rest from the trigger on); with no trigger yet, (what is surely text, None),
    a tail that may be the trigger's beginning held back."""
    found = text.find(trigger)
    if found >= 0:
        return text[:found], text[found:]
    for keep in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-keep:]):
            return text[:-keep], None
    return text, None


def _lark_literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's); nothing for empty text."""
    return json.dumps(text) if text else ""
