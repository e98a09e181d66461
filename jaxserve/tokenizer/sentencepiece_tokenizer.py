"""`SentencePieceTokenizer`: the Llama 2 family's `tokenizer.model`, through the sentencepiece library."""

from __future__ import annotations

import itertools
from pathlib import Path

import sentencepiece

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer.base import Tokenizer
from jaxserve.tokenizer.chat_template import ChatTemplate
from jaxserve.tokenizer.settings import TokenizerSettings
from jaxserve.tokenizer.token_bytes import metaspace_bytes

WORD_BOUNDARY = "\u2581"  # "▁", the piece prefix sentencepiece uses for a space


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; BOS is added by default and EOS is not, as Llama 2 expects."""

    def __init__(self, model_file: Path, settings: TokenizerSettings, chat_template: ChatTemplate | None = None):
        self._processor = _load_processor(model_file)
        self._vocab_size = self._processor.get_piece_size()
        self._special_ids = frozenset(
            i for i in range(self._vocab_size) if self._processor.is_control(i) or self._processor.is_unknown(i)
        )
        self._strips_first_space = _decoder_strips_first_space(self._processor)
        special = self._resolve_special_tokens(
            settings, _optional_id(self._processor.bos_id()), _optional_id(self._processor.eos_id()), str(model_file)
        )
        add_bos = settings.add_bos_token if settings.add_bos_token is not None else True
        super().__init__(special, add_bos and special.bos_token_id is not None, chat_template)
        self._eos_to_append = special.eos_token_ids[:1] if settings.add_eos_token else ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special token spellings inside `text` are encoded as plain characters."""
        ids = self._processor.encode(text)
        if not add_special_tokens:
            return ids
        bos = [self.bos_token_id] if self.add_bos_token else []
        return bos + ids + list(self._eos_to_append)

    def decode_valid(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; kept special tokens appear as their piece spelling."""
        if skip_special_tokens:
            return self._processor.decode([i for i in ids if i not in self._special_ids])
        return self._decode_with_special_pieces(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """From the piece: "▁" stands for a space, "<0xNN>" for one byte; control pieces ("<s>") are their text."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        return piece.encode() if token_id in self._special_ids else metaspace_bytes(piece)

    def token_to_id(self, token: str) -> int | None:
        """Id of the piece `token`; sentencepiece answers the unknown id for strangers, so check the round trip."""
        token_id = self._processor.piece_to_id(token)
        return token_id if self._processor.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        """Spelling of piece `token_id` ("▁Hello", "<0x0A>", "<s>")."""
        return self._processor.id_to_piece(token_id) if 0 <= token_id < self._vocab_size else None

    def _decode_with_special_pieces(self, ids: list[int]) -> str:
        """Decode the text between special tokens run by run, spelling the special tokens out.

        sentencepiece drops the space that starts a text, taking it for the dummy prefix it adds when encoding.
        Only the text's very first run started one, so later runs get that space back.
        """
        parts: list[str] = []
        for is_special, group in itertools.groupby(ids, key=self._special_ids.__contains__):
            run = list(group)
            if is_special:
                parts.append("".join(self._processor.id_to_piece(i) for i in run))
            else:
                parts.append(self._decode_run(run, starts_text=not parts))
        return "".join(parts)

    def _decode_run(self, run: list[int], starts_text: bool) -> str:
        text = self._processor.decode(run)
        if not starts_text and self._strips_first_space and self._processor.id_to_piece(run[0]).startswith(
                WORD_BOUNDARY):
            return " " + text
        return text


def _load_processor(model_file: Path) -> sentencepiece.SentencePieceProcessor:
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError, ValueError) as e:
        raise TokenizerError(f"{model_file} is not a readable SentencePiece model: {e}") from None


def _optional_id(token_id: int) -> int | None:
    """sentencepiece reports a disabled special piece as id -1."""
    return token_id if token_id >= 0 else None


def _decoder_strips_first_space(processor: sentencepiece.SentencePieceProcessor) -> bool:
    """Whether decoding drops the leading space of the first piece (models trained with a dummy prefix do).

    Asked of the decoder itself with one word-initial piece, rather than read from the model's normalizer spec,
    which would need the protobuf schema.
    """
    for token_id in range(processor.get_piece_size()):
        piece = processor.id_to_piece(token_id)
        # "▁x" shows the stripping plainly; "▁▁" would still start with a space after losing one.
        if len(piece) > 1 and piece[0] == WORD_BOUNDARY != piece[1] and _is_plain_piece(processor, token_id):
            return not processor.decode([token_id]).startswith(" ")
    return False


def _is_plain_piece(processor: sentencepiece.SentencePieceProcessor, token_id: int) -> bool:
    return not (processor.is_control(token_id) or processor.is_unknown(token_id) or processor.is_byte(token_id)
                or processor.is_unused(token_id))
