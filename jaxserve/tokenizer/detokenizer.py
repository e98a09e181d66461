"""`IncrementalDetokenizer`: streamed token ids to streamed text, each piece final when returned.

Decoding tokens one at a time goes wrong in two ways: a character split over several byte tokens shows up as
U+FFFD, and sentencepiece drops the space that starts a decoded text. So each push decodes a short window instead:
a few tokens whose text was already returned (the context, which fixes leading spaces and merges) followed by the
tokens whose text is still pending. What the window decodes to beyond the context's own text is the new text; a
trailing U+FFFD in it may be a character still incomplete, so it is held back until more tokens arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.tokenizer.base import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"
# Tokens of already-returned text decoded again ahead of new tokens. One gives sentencepiece its leading space; a
# few more give decoder steps that look across tokens (Fuse, Strip) the same view as in a full decode.
CONTEXT_TOKENS = 4
# Bytes in the longest UTF-8 character: how far back a token boundary can be from the character's start.
MAX_CHARACTER_BYTES = 4
# The window is cut back to CONTEXT_TOKENS once it grows past this, so a push decodes a bounded number of tokens.
MAX_WINDOW_TOKENS = 16
# A stream whose text keeps ending in an undecodable byte sequence is released after this many tokens. The full
# decode shows replacement characters there too, unless the very next bytes happen to complete the character.
MAX_HELD_TOKENS = 32


class IncrementalDetokenizer:
    """Text of a generated token stream, released piece by piece without breaking characters or spaces.

    Concatenating every `push` result and the final `flush` gives `tokenizer.decode(generated_ids)`, or with
    `prompt_ids` the text the generated ids add after the prompt (so a first token " Hello" keeps its space).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._silent_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._window: list[int] = []  # context tokens, then the pending ones
        self._context_chars = 0  # length of the text the context tokens decode to
        self._returned_chars = 0  # characters past the context's text that were already returned
        self._pending_tokens = 0  # tokens at the window's end whose text is not all returned yet
        self._pieces: list[str] = []
        self._start_context([int(i) for i in prompt_ids if self._produces_text(i)])

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that became final ("" while a character is incomplete)."""
        if not self._produces_text(token_id):
            return ""
        self._window.append(token_id)
        self._pending_tokens += 1
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHARACTER) and self._pending_tokens <= MAX_HELD_TOKENS:
            return self._release(text.rstrip(REPLACEMENT_CHARACTER))
        piece = self._release(text)
        self._settle(text)
        return piece

    def flush(self) -> str:
        """End of stream: returns the text still held back, such as a trailing replacement character."""
        if not self._pending_tokens:
            return ""
        text = self._decode(self._window)
        piece = self._release(text)
        self._settle(text)
        return piece

    def _produces_text(self, token_id: int) -> bool:
        """Skipped special tokens and ids outside the vocabulary decode to nothing, so they need no window slot."""
        return token_id not in self._silent_ids and 0 <= token_id < self._tokenizer.vocab_size

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode_valid(ids, self._skip_special_tokens)  # _produces_text kept them in range

    def _release(self, final_text: str) -> str:
        """Return the part of the window's `final_text` beyond the context and beyond what was returned before."""
        piece = final_text[self._context_chars + self._returned_chars:]
        if piece:
            self._returned_chars += len(piece)
            self._pieces.append(piece)
        return piece

    def _settle(self, text: str) -> None:
        """All of the window's `text` is returned: the whole window becomes context, cut back when too long."""
        self._pending_tokens = 0
        self._returned_chars = 0
        if len(self._window) > MAX_WINDOW_TOKENS:
            self._start_context(self._window)
        else:
            self._context_chars = len(text)

    def _start_context(self, ids: list[int]) -> None:
        """Make the last CONTEXT_TOKENS of `ids` the context, moved back to where a character starts.

        Cut inside a character, the context would decode to U+FFFD where the full text has that character; the
        ByteFallback decoder of Llama 2's tokenizer.json would even spoil the whole run of byte tokens after it.
        """
        start = max(len(ids) - CONTEXT_TOKENS, 0)
        for candidate in range(start, max(start - MAX_CHARACTER_BYTES + 1, 0) - 1, -1):
            text = self._decode(ids[candidate:])
            if not text.startswith(REPLACEMENT_CHARACTER):
                break
        self._window = ids[candidate:]
        self._context_chars = len(text)
