"""Stop-string matching on streamed text, correct when a stop string spans several tokens.

Text is released only once no stop string can still begin inside it: the longest suffix that is a prefix of some
stop string is held back until the next piece decides it. A stream therefore never shows text it must later retract.
"""

from __future__ import annotations


class StopStringMatcher:
    """Feeds text deltas, releases the part that is certainly output, and reports the first stop string seen."""

    def __init__(self, stops: tuple[str, ...], include_stop_in_output: bool = False):
        self._stops = stops
        self._include = include_stop_in_output
        self._held = ""  # text that might be the start of a stop string

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text now safe to emit, matched stop string or None). After a match, feed no more."""
        if not self._stops:
            return delta, None
        buffer = self._held + delta
        match = _earliest_match(buffer, self._stops)
        if match is not None:
            start, stop = match
            self._held = ""
            return buffer[: start + (len(stop) if self._include else 0)], stop
        keep = _longest_partial_suffix(buffer, self._stops)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Releases held-back text when the stream ends for another reason."""
        held, self._held = self._held, ""
        return held


def _earliest_match(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stops]
    found = [(i, s) for i, s in found if i >= 0]
    return min(found, key=lambda item: item[0]) if found else None


def _longest_partial_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
