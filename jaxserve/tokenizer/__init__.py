"""Tokenizers for the served models: encoding, decoding, streaming decode and chat templates.

`load_tokenizer(model_dir)` picks the backend the folder needs: HF `tokenizers` for a `tokenizer.json` (Llama 3
family), sentencepiece for a `tokenizer.model` (Llama 2 family).
"""

from jaxserve.tokenizer.base import SpecialTokens, Tokenizer
from jaxserve.tokenizer.byte_stream import ByteStreamDetokenizer, streaming_detokenizer
from jaxserve.tokenizer.chat_template import ChatTemplate, flatten_text_content
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer.hf_tokenizer import HuggingFaceTokenizer
from jaxserve.tokenizer.loader import load_tokenizer
from jaxserve.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

__all__ = [
    "ByteStreamDetokenizer",
    "ChatTemplate",
    "HuggingFaceTokenizer",
    "IncrementalDetokenizer",
    "SentencePieceTokenizer",
    "SpecialTokens",
    "Tokenizer",
    "flatten_text_content",
    "load_tokenizer",
    "streaming_detokenizer",
]
