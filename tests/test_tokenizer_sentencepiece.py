"""The sentencepiece backend against the sentencepiece library itself, and transformers' Llama tokenizer."""

import re
from pathlib import Path

import pytest
import sentencepiece

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer import SentencePieceTokenizer, load_tokenizer
from tests.tokenizer_fixtures import TRICKY_TEXTS, make_llama2_folder, train_sentencepiece, write_json


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama2_folder(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="module")
def processor(sentencepiece_dir: Path) -> sentencepiece.SentencePieceProcessor:
    return sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_dir / "tokenizer.model"))


@pytest.fixture(scope="module")
def tokenizer(sentencepiece_dir: Path) -> SentencePieceTokenizer:
    tokenizer = load_tokenizer(sentencepiece_dir)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    return tokenizer


def llama2_folder(tmp_path: Path, sentencepiece_dir: Path, **files: dict) -> Path:
    """A copy of the sentencepiece folder with the given JSON files (name without .json) replaced or added."""
    (tmp_path / "tokenizer.model").write_bytes((sentencepiece_dir / "tokenizer.model").read_bytes())
    for name, content in files.items():
        write_json(tmp_path / f"{name}.json", content)
    return tmp_path


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_encode_matches_sentencepiece_with_bos_only_when_asked(tokenizer, processor, text):
    assert tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)
    assert tokenizer.encode(text) == [processor.bos_id(), *processor.encode(text)]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_decode_matches_sentencepiece_and_round_trips(tokenizer, processor, text):
    ids = processor.encode(text)
    assert tokenizer.decode(ids) == processor.decode(ids) == text
    assert tokenizer.decode([processor.bos_id(), *ids, processor.eos_id()]) == text


def test_rare_characters_fall_back_to_byte_pieces(tokenizer, processor):
    ids = tokenizer.encode("ꙮ", add_special_tokens=False)
    assert [processor.id_to_piece(i) for i in ids] == ["▁", "<0xEA>", "<0x99>", "<0xAE>"]
    assert tokenizer.decode(ids) == "ꙮ"


def test_special_tokens_follow_llama2(tokenizer, processor):
    assert tokenizer.vocab_size == processor.get_piece_size() == 420
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_ids) == ("</s>", (2,))
    assert tokenizer.add_bos_token is True
    assert tokenizer.all_special_ids == frozenset({0, 1, 2})


def test_kept_special_tokens_are_spelled_out_and_later_text_keeps_its_space(tokenizer, processor):
    world = processor.encode("world")
    assert processor.id_to_piece(world[0]).startswith("▁")
    ids = [1, *processor.encode("Hello"), 2, *world]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s> Hello</s> world"
    assert tokenizer.decode(ids) == "Hello world"


def test_model_without_dummy_prefix_keeps_every_space(tmp_path):
    train_sentencepiece(tmp_path / "tokenizer.model", add_dummy_prefix=False)
    tokenizer = load_tokenizer(tmp_path)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    for text in TRICKY_TEXTS:
        ids = processor.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == ids
        assert tokenizer.decode(ids) == processor.decode(ids) == text
    world = processor.encode(" world")
    assert tokenizer.decode([1, *world], skip_special_tokens=False) == "<s> world"


@pytest.mark.parity
@pytest.mark.parametrize("text", ["Hello world", "  two  spaces", "line\nbreak", "emoji 😀 and 日本"])
def test_decode_with_special_tokens_matches_transformers(tokenizer, sentencepiece_dir, text):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(sentencepiece_dir)
    ids = [1, *tokenizer.encode(text, add_special_tokens=False), 2, *tokenizer.encode(text, add_special_tokens=False)]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_ids_outside_the_vocabulary_decode_to_nothing(tokenizer, processor):
    ids = processor.encode("Hello")
    assert tokenizer.decode([*ids, 420, 10**6, -1]) == "Hello"


def test_config_flags_control_bos_and_eos(tmp_path, sentencepiece_dir, processor):
    flags = {"add_bos_token": False, "add_eos_token": True}
    folder = llama2_folder(tmp_path, sentencepiece_dir, tokenizer_config=flags)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.add_bos_token is False
    assert tokenizer.encode("Hello") == [*processor.encode("Hello"), 2]
    assert tokenizer.encode("Hello", add_special_tokens=False) == processor.encode("Hello")


@pytest.mark.parity
@pytest.mark.parametrize("flags", [{"add_bos_token": True}, {"add_bos_token": False},
                                   {"add_bos_token": False, "add_eos_token": True},
                                   {"add_bos_token": True, "add_eos_token": True}])
def test_config_flags_match_transformers(tmp_path, sentencepiece_dir, flags):
    """Flags always given: with none, transformers 5 adds no BOS, unlike Llama 2 (and transformers 4) expect.
    Only texts without a leading space: transformers 5 converts the model to a Metaspace tokenizer that, unlike
    sentencepiece, adds no dummy prefix before a space that is already there."""
    transformers = pytest.importorskip("transformers")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", **flags}
    folder = llama2_folder(tmp_path, sentencepiece_dir, tokenizer_config=config)
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("Hello world", "line\nbreak", "emoji 😀"):
        assert ours.encode(text) == theirs.encode(text)


def test_without_side_files_the_model_defines_bos_and_eos(tmp_path, sentencepiece_dir, processor):
    tokenizer = load_tokenizer(llama2_folder(tmp_path, sentencepiece_dir))
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token_ids) == ("<s>", 1, (2,))
    assert tokenizer.encode("Hello") == [1, *processor.encode("Hello")]
    assert tokenizer.chat_template is None


def test_generation_config_adds_eos_ids_after_the_configured_one(tmp_path, sentencepiece_dir):
    folder = llama2_folder(tmp_path, sentencepiece_dir, tokenizer_config={"eos_token": "</s>"},
                           generation_config={"eos_token_id": [7, 2, 7]})
    assert load_tokenizer(folder).eos_token_ids == (2, 7)


def test_unknown_special_token_in_config_is_an_error(tmp_path, sentencepiece_dir):
    folder = llama2_folder(tmp_path, sentencepiece_dir, tokenizer_config={"eos_token": "<|not-a-piece|>"})
    with pytest.raises(TokenizerError, match=r"not-a-piece.*tokenizer\.model"):
        load_tokenizer(folder)


def test_corrupt_model_file_names_the_file(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00 definitely not a protobuf \xff")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.model"))):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_token_bytes_join_to_what_sentencepiece_decodes(tokenizer, processor, text):
    ids = processor.encode(text)
    joined = b"".join(tokenizer.token_bytes(i) for i in ids).decode()
    assert joined.removeprefix(" ") == processor.decode(ids)
    assert tokenizer.token_bytes(processor.bos_id()) == b"<s>" and tokenizer.token_bytes(10**6) == b""
