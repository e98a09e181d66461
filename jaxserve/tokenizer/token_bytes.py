"""The bytes a vocabulary entry stands for, from its spelling: what OpenAI's logprob `bytes` report, so that a token
holding part of a UTF-8 character reports that part, not the replacement character its text decodes to."""

from __future__ import annotations

import functools
import re

METASPACE = "\u2581"  # sentencepiece's "▁", standing for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3) spells byte b with a printable character: b itself when printable, else
    256 + its index among the unprintable bytes. This is that map, character → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(unprintable)}}


def byte_level_bytes(spelling: str) -> bytes:
    """A byte-level BPE spelling ("Ġhello") as its bytes (b" hello")."""
    alphabet = byte_level_alphabet()
    return bytes(alphabet[char] for char in spelling)


def metaspace_bytes(spelling: str) -> bytes:
    """A sentencepiece-style spelling ("▁hello", "<0xE2>") as its bytes (b" hello", b"\\xe2")."""
    byte = _BYTE_PIECE.fullmatch(spelling)
    return bytes([int(byte.group(1), 16)]) if byte else spelling.replace(METASPACE, " ").encode()
