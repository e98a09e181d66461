"""`Tokenizer`: the interface both backends implement, and the parts they share.

A backend only wraps its library's encode/decode and vocabulary lookups. Which ids are BOS and EOS, and how a chat
is rendered, is decided here from the model folder's settings, so both backends behave alike.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer.chat_template import ChatTemplate, Message
from jaxserve.tokenizer.settings import TokenizerSettings


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The begin- and end-of-sequence tokens of a model, as strings and ids."""

    bos_token: str | None  # text of the BOS token, passed to chat templates
    bos_token_id: int | None  # id of the BOS token
    eos_token: str | None  # text of the primary EOS token, passed to chat templates
    eos_token_ids: tuple[int, ...]  # every id that ends generation, primary first, no duplicates


class Tokenizer(abc.ABC):
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(self, special: SpecialTokens, add_bos_token: bool, chat_template: ChatTemplate | None):
        self._special = special
        self._add_bos_token = add_bos_token
        self._chat_template = chat_template

    # Backends set these two before calling Tokenizer.__init__ (special-token checks need the vocabulary size).
    _vocab_size: int
    _special_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added and special tokens included (highest id + 1)."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out."""
        return self._special_ids

    @property
    def streams_token_bytes(self) -> bool:
        """Whether `decode(ids)` is exactly the ids' `token_bytes` joined and decoded as UTF-8 (invalid bytes
        replaced): then text streams by bytes (tokenizer/byte_stream.py) with nothing decoded twice."""
        return False

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most UTF-8 bytes of any vocabulary spelling: no token covers more input than its spelling's bytes
        (byte-level and sentencepiece spellings are at least as long as what they stand for), so text of more than
        n times this many bytes has more than n tokens, which is known without tokenizing it."""
        spellings = (self.id_to_token(token_id) for token_id in range(self.vocab_size))
        return max((len(spelling.encode()) for spelling in spellings if spelling is not None), default=1)

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the model's BOS (and EOS, if configured) are added."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids outside the vocabulary produce no text, as in HF `tokenizers`."""
        return self.decode_valid(self._ids_in_vocabulary(ids), skip_special_tokens)

    @abc.abstractmethod
    def decode_valid(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, Python ints already known to lie in the vocabulary: `decode` without the check, for the
        streaming detokenizer, which decodes every generated token's window and filters ids once per token."""

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for: part of a UTF-8 character stays that part; a special or added token is
        its text; an id outside the vocabulary is empty."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry spelled exactly `token`, or None."""

    @abc.abstractmethod
    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of `token_id` (not its decoded text), or None when out of range."""

    @property
    def bos_token_id(self) -> int | None:
        """Id of the begin-of-sequence token, if the model has one."""
        return self._special.bos_token_id

    @property
    def bos_token(self) -> str | None:
        """Text of the begin-of-sequence token, if the model has one."""
        return self._special.bos_token

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (tokenizer_config.json's eos_token first, then generation_config.json's)."""
        return self._special.eos_token_ids

    @property
    def eos_token(self) -> str | None:
        """Text of the primary end-of-sequence token."""
        return self._special.eos_token

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(text, add_special_tokens=True)` starts with the BOS id."""
        return self._add_bos_token

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template, compiled, or None when the folder has none."""
        return self._chat_template

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render `messages` to prompt text; encode it with `add_special_tokens=False`, the template adds BOS."""
        if self._chat_template is None:
            raise TokenizerError("this model has no chat template (no chat_template.jinja and no chat_template "
                                 "in tokenizer_config.json); use the completions endpoint instead")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def _ids_in_vocabulary(self, ids: Iterable[int]) -> list[int]:
        vocab_size = self.vocab_size
        return [int(i) for i in ids if 0 <= i < vocab_size]

    def _resolve_special_tokens(self, settings: TokenizerSettings, default_bos_id: int | None,
                                default_eos_id: int | None, vocabulary_file: str) -> SpecialTokens:
        """Combine what the model folder says about BOS/EOS with the library's own ids.

        The folder names tokens by string (tokenizer_config.json) or by id (generation_config.json); the library's
        own ids only fill in when the folder names none.
        """
        bos_token = self._configured_bos_token(settings, default_bos_id, vocabulary_file)
        eos_ids = [self._required_id(settings.eos_token, "eos_token", vocabulary_file)] if settings.eos_token else []
        eos_ids += [self._checked_id(i, "eos_token_id", vocabulary_file) for i in settings.generation_eos_token_ids]
        if not eos_ids and default_eos_id is not None:
            eos_ids = [default_eos_id]
        eos_ids = list(dict.fromkeys(eos_ids))
        eos_token = settings.eos_token if settings.eos_token else self._spelling(eos_ids[0] if eos_ids else None)
        return SpecialTokens(
            bos_token=bos_token,
            bos_token_id=self._required_id(bos_token, "bos_token", vocabulary_file) if bos_token else None,
            eos_token=eos_token,
            eos_token_ids=tuple(eos_ids),
        )

    def _configured_bos_token(self, settings: TokenizerSettings, default_bos_id: int | None,
                              vocabulary_file: str) -> str | None:
        if settings.bos_token:
            return settings.bos_token
        if settings.generation_bos_token_id is not None:
            return self._spelling(self._checked_id(settings.generation_bos_token_id, "bos_token_id", vocabulary_file))
        return self._spelling(default_bos_id)

    def _spelling(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_token(token_id)

    def _required_id(self, token: str, setting: str, vocabulary_file: str) -> int:
        token_id = self.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{setting} {token!r} from the model folder is not in the vocabulary of "
                                 f"{vocabulary_file}")
        return token_id

    def _checked_id(self, token_id: int, setting: str, vocabulary_file: str) -> int:
        if token_id >= self.vocab_size:
            raise TokenizerError(f"generation_config.json {setting} {token_id} is outside the vocabulary of "
                                 f"{vocabulary_file} ({self.vocab_size} ids)")
        return token_id

