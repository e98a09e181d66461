"""`load_tokenizer`: pick the backend a model folder needs and load it with the folder's settings."""

from __future__ import annotations

from pathlib import Path

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer.base import Tokenizer
from jaxserve.tokenizer.chat_template import ChatTemplate
from jaxserve.tokenizer.hf_tokenizer import HuggingFaceTokenizer
from jaxserve.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from jaxserve.tokenizer.settings import read_tokenizer_settings

HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """Load the tokenizer of `model_dir`; raises TokenizerError naming the folder or file at fault.

    `tokenizer.json` is preferred when both files exist (Llama 2 repositories ship both, and the two agree);
    `tokenizer.model` alone means a SentencePiece model.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerError(f"model folder {model_dir} does not exist or is not a folder")
    settings = read_tokenizer_settings(model_dir)
    template = settings.chat_template
    chat_template = ChatTemplate(template.text, origin=template.origin) if template else None
    if (model_dir / HF_TOKENIZER_FILE).is_file():
        return HuggingFaceTokenizer(model_dir / HF_TOKENIZER_FILE, settings, chat_template)
    if (model_dir / SENTENCEPIECE_FILE).is_file():
        return SentencePieceTokenizer(model_dir / SENTENCEPIECE_FILE, settings, chat_template)
    raise TokenizerError(f"model folder {model_dir} has neither {HF_TOKENIZER_FILE} nor {SENTENCEPIECE_FILE}")
