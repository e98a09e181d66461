"""`HuggingFaceTokenizer`: a `tokenizer.json` (Llama 3 family) through the HF `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer.base import SpecialTokens, Tokenizer
from jaxserve.tokenizer.chat_template import ChatTemplate
from jaxserve.tokenizer.settings import TokenizerSettings
from jaxserve.tokenizer.token_bytes import byte_level_bytes, metaspace_bytes


class HuggingFaceTokenizer(Tokenizer):
    """A `tokenizer.json`, adding BOS/EOS exactly as transformers 5 does.

    The file's post-processor alone decides (Llama 3's TemplateProcessing prepends <|begin_of_text|>):
    transformers 5 drops tokenizer_config.json's `add_bos_token`/`add_eos_token` whenever a tokenizer.json exists.
    """

    def __init__(self, tokenizer_file: Path, settings: TokenizerSettings, chat_template: ChatTemplate | None = None):
        self._backend = _load_backend(tokenizer_file)
        # A tokenizer.json may carry training-time truncation or padding; prompts must come through whole.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._vocab_size = max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        special = self._resolve_special_tokens(settings, None, None, str(tokenizer_file))
        self._mark_as_special(special)
        self._special_ids = frozenset(
            token_id for token_id, token in self._backend.get_added_tokens_decoder().items() if token.special
        )
        super().__init__(special, self._post_processor_adds(special.bos_token_id), chat_template)
        self._added_ids = frozenset(self._backend.get_added_tokens_decoder())  # spelled as their text
        self._byte_level = _decodes_byte_level(self._backend)
        self._streams_bytes = _decodes_by_bytes_alone(self._backend)
        self._bytes_of: dict[int, bytes] = {}  # token_bytes, computed once per id (streaming reads it per token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; added-token spellings in `text` (e.g. "<|eot_id|>") become those tokens."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode_valid(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, without transformers' `clean_up_tokenization_spaces` (transformers 5 skips it for BPE)."""
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def streams_token_bytes(self) -> bool:
        return self._streams_bytes

    def token_bytes(self, token_id: int) -> bytes:
        """From the spelling: byte-level vocabularies map each character to a byte, the others (sentencepiece
        converted) spell a space as "▁" and a lone byte as "<0xNN>"."""
        known = self._bytes_of.get(token_id)
        if known is None:
            known = self._bytes_of[token_id] = self._spelled_bytes(token_id)
        return known

    def _spelled_bytes(self, token_id: int) -> bytes:
        spelling = self.id_to_token(token_id)
        if spelling is None:
            return b""
        if token_id in self._added_ids:
            return spelling.encode()
        return byte_level_bytes(spelling) if self._byte_level else metaspace_bytes(spelling)

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry or added token spelled `token`."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Spelling of `token_id` in tokenizer.json ("Ġhello" in byte-level vocabularies)."""
        return self._backend.id_to_token(token_id) if 0 <= token_id < self._vocab_size else None

    def _mark_as_special(self, special: SpecialTokens) -> None:
        """transformers registers the configured BOS/EOS as special added tokens; decoding then skips them."""
        ids = [special.bos_token_id, *special.eos_token_ids]
        special_now = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        missing = [self._backend.id_to_token(i) for i in ids if i is not None and i not in special_now]
        if missing:
            self._backend.add_special_tokens(
                [tokenizers.AddedToken(token, special=True, normalized=False) for token in dict.fromkeys(missing)]
            )

    def _post_processor_adds(self, token_id: int | None) -> bool:
        """Whether encoding with special tokens starts with `token_id`, whatever post-processor produced it."""
        if token_id is None:
            return False
        return self._backend.encode("", add_special_tokens=True).ids[:1] == [token_id]


def _decodes_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """Whether the file's decoder (or one of a sequence of them) is ByteLevel."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


def _decodes_by_bytes_alone(backend: tokenizers.Tokenizer) -> bool:
    """Whether decoding is the tokens' bytes joined: a BPE model whose only decoder is ByteLevel, with added tokens
    in ASCII (ByteLevel maps each printable ASCII character to itself and passes a token holding any character
    outside its alphabet through as UTF-8, so such a token's bytes are its text)."""
    config = json.loads(backend.to_str())
    decoder = config.get("decoder") or {}
    return (config.get("model", {}).get("type") == "BPE" and decoder.get("type") == "ByteLevel"
            and all(token["content"].isascii() for token in config.get("added_tokens") or ()))


def _load_backend(tokenizer_file: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust binding raises bare Exception for I/O and parse errors alike
        raise TokenizerError(f"{tokenizer_file} is not a readable tokenizer.json: {e}") from None

