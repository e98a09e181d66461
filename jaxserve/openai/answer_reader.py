"""`AnswerReader`: one chat answer's text, as it streams or whole, told apart into reasoning (with a reasoning
format), tool calls (with tools the model may call) and content, for the message or for each streamed delta."""

from __future__ import annotations

import dataclasses

from jaxserve.openai.reasoning import AnswerText, Reasoning, ReasoningParser, ReasoningText
from jaxserve.openai.tool_calls import ContentText, ParsedCall, ParsedEvent, ToolCalling, ToolCallParser


@dataclasses.dataclass(frozen=True)
class Said:
    """What a piece of an answer added."""

    reasoning: str  # reasoning text ("" without any)
    content: str  # content text ("" without any)
    call_events: list[ParsedEvent]  # tool calls begun or grown (content events among them already in `content`)


class AnswerReader:
    """Reads one answer: the reasoning split off first, then calls read from what follows it."""

    def __init__(self, reasoning: Reasoning | None, tool_calling: ToolCalling | None):
        self._reasoning = ReasoningParser(reasoning) if reasoning is not None else None
        self._calls = ToolCallParser(tool_calling) if tool_calling is not None else None

    @property
    def calls(self) -> list[ParsedCall]:
        """The tool calls read so far."""
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> Said:
        """What `text`, the answer's next piece, adds."""
        pieces = self._reasoning.feed(text) if self._reasoning is not None else [AnswerText(text)]
        return self._said(pieces, finished=False)

    def finish(self) -> Said:
        """The answer ended: what was held back."""
        return self._said(self._reasoning.finish() if self._reasoning is not None else [], finished=True)

    def _said(self, pieces: list[ReasoningText | AnswerText], finished: bool) -> Said:
        reasoning = "".join(piece.text for piece in pieces if isinstance(piece, ReasoningText))
        answer = "".join(piece.text for piece in pieces if isinstance(piece, AnswerText))
        if self._calls is None:
            return Said(reasoning, answer, [])
        events = (self._calls.feed(answer) if answer else []) + (self._calls.finish() if finished else [])
        content = "".join(event.text for event in events if isinstance(event, ContentText))
        return Said(reasoning, content, [event for event in events if not isinstance(event, ContentText)])


def read_answer(text: str, reasoning: Reasoning | None,
                tool_calling: ToolCalling | None) -> tuple[Said, list[ParsedCall]]:
    """A whole answer read at once: all it said, and its calls."""
    reader = AnswerReader(reasoning, tool_calling)
    first, last = reader.feed(text), reader.finish()
    return Said(first.reasoning + last.reasoning, first.content + last.content,
                first.call_events + last.call_events), reader.calls
