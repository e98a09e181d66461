"""The HF `tokenizers` backend and the loader, against `tokenizers` itself and transformers' AutoTokenizer."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import tokenizers

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer import HuggingFaceTokenizer, load_tokenizer
from tests.tokenizer_fixtures import (
    BUILTIN_DIR,
    TRICKY_TEXTS,
    copy_builtin_tokenizer,
    make_llama2_folder,
    write_json,
)

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
BUILTIN_SPECIAL_IDS = {"<|begin_of_text|>": 507, "<|end_of_text|>": 508, "<|start_header_id|>": 509,
                       "<|end_header_id|>": 510, "<|eot_id|>": 511}


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama2_folder(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="module")
def builtin() -> HuggingFaceTokenizer:
    tokenizer = load_tokenizer(BUILTIN_DIR)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def reference() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))


def edit_json(path: Path, **changes) -> None:
    content = json.loads(path.read_text(encoding="utf-8"))
    write_json(path, {**content, **changes})


@pytest.mark.parametrize("text", [*TRICKY_TEXTS, "<|eot_id|> inside text"])
def test_encode_and_decode_match_tokenizers(builtin, reference, text):
    for add_special_tokens in (True, False):
        expected = reference.encode(text, add_special_tokens=add_special_tokens).ids
        assert builtin.encode(text, add_special_tokens=add_special_tokens) == expected
    ids = reference.encode(text).ids
    assert builtin.decode(ids) == reference.decode(ids)
    assert builtin.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert builtin.decode(ids[1:], skip_special_tokens=False) == text


def test_builtin_vocabulary_and_special_tokens(builtin):
    assert builtin.vocab_size == 512
    assert {token: builtin.token_to_id(token) for token in BUILTIN_SPECIAL_IDS} == BUILTIN_SPECIAL_IDS
    assert (builtin.bos_token, builtin.bos_token_id) == ("<|begin_of_text|>", 507)
    assert (builtin.eos_token, builtin.eos_token_ids) == ("<|eot_id|>", (511, 508))  # generation_config.json adds 508
    assert builtin.add_bos_token is True
    assert builtin.all_special_ids == frozenset(BUILTIN_SPECIAL_IDS.values())
    assert builtin.encode("hi")[0] == 507


def test_builtin_tokenizer_is_small():
    assert (BUILTIN_DIR / "tokenizer.json").stat().st_size < 100_000


def test_ids_outside_the_vocabulary_decode_to_nothing(builtin):
    assert builtin.decode([*builtin.encode("Hello", add_special_tokens=False), 512, 10**6, -3]) == "Hello"


def builtin_variant(folder: Path, variant: str) -> Path:
    """The built-in tokenizer with one change to the settings that could decide whether BOS or EOS is added."""
    copy_builtin_tokenizer(folder)
    if variant == "no_bos_flag":
        edit_json(folder / "tokenizer_config.json", add_bos_token=False)
    elif variant == "eos_flag":
        edit_json(folder / "tokenizer_config.json", add_eos_token=True)
    elif variant == "no_post_processor":
        edit_json(folder / "tokenizer.json", post_processor=None)
    elif variant == "token_dicts":
        edit_json(folder / "tokenizer_config.json",
                  bos_token={"__type": "AddedToken", "content": "<|begin_of_text|>", "special": True},
                  eos_token={"__type": "AddedToken", "content": "<|end_of_text|>", "lstrip": False})
    return folder


@pytest.mark.parity
@pytest.mark.parametrize("variant", ["as_shipped", "no_bos_flag", "eos_flag", "no_post_processor", "token_dicts"])
def test_bos_and_eos_handling_matches_transformers(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    folder = builtin_variant(tmp_path, variant)
    ours = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_token_id, ours.eos_token_ids[0]) == (theirs.bos_token_id, theirs.eos_token_id)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    skipped_by_theirs = {i for i in range(ours.vocab_size) if theirs.decode([i], skip_special_tokens=True) == ""}
    assert ours.all_special_ids == skipped_by_theirs
    for text in ("Hello world", "", " leading", "<|eot_id|>x"):
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.add_bos_token == (theirs.encode("x")[0] == theirs.bos_token_id)


@pytest.fixture(scope="module")
def llama2_tokenizer_json_dir(tmp_path_factory, sentencepiece_dir) -> Path:
    """transformers converts the sentencepiece model into a Metaspace/ByteFallback tokenizer.json, as Llama 2 ships."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama2_tokenizer_json")
    transformers.AutoTokenizer.from_pretrained(sentencepiece_dir).save_pretrained(folder)
    return folder


@pytest.mark.parity
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_llama2_style_tokenizer_json_matches_transformers(llama2_tokenizer_json_dir, text):
    transformers = pytest.importorskip("transformers")
    folder = llama2_tokenizer_json_dir
    ours, theirs = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, HuggingFaceTokenizer)
    ids = theirs.encode(text)
    assert ours.encode(text) == ids
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_generation_config_eos_ids_are_merged_in_order(tmp_path):
    folder = copy_builtin_tokenizer(tmp_path)
    write_json(folder / "generation_config.json", {"bos_token_id": 507, "eos_token_id": [508, 511, 509]})
    assert load_tokenizer(folder).eos_token_ids == (511, 508, 509)


def test_generation_config_alone_names_bos_and_eos(tmp_path):
    folder = copy_builtin_tokenizer(tmp_path)
    (folder / "tokenizer_config.json").unlink()
    write_json(folder / "generation_config.json", {"bos_token_id": 507, "eos_token_id": 508})
    tokenizer = load_tokenizer(folder)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_ids) == (
        "<|begin_of_text|>", "<|end_of_text|>", (508,))
    assert tokenizer.chat_template is None


def test_preferred_over_tokenizer_model(tmp_path, sentencepiece_dir):
    folder = copy_builtin_tokenizer(tmp_path)
    (folder / "tokenizer.model").write_bytes((sentencepiece_dir / "tokenizer.model").read_bytes())
    assert isinstance(load_tokenizer(folder), HuggingFaceTokenizer)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "absent"))):
        load_tokenizer(tmp_path / "absent")


def test_folder_without_tokenizer_files_is_named(tmp_path):
    write_json(tmp_path / "config.json", {"model_type": "llama"})
    complaint = f"{tmp_path} has neither tokenizer.json nor tokenizer.model"
    with pytest.raises(TokenizerError, match=re.escape(complaint)):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name, content, complaint", [
    ("tokenizer_config.json", "{not json", "not valid JSON"),
    ("tokenizer_config.json", "[1, 2]", "JSON object"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token"),
    ("tokenizer_config.json", '{"add_bos_token": "yes"}', "add_bos_token"),
    ("tokenizer_config.json", '{"eos_token": "<|no such token|>"}', "no such token"),
    ("generation_config.json", '{"eos_token_id": "2"}', "eos_token_id"),
    ("generation_config.json", '{"eos_token_id": [511, 9999]}', "9999"),
])
def test_malformed_side_files_are_reported(tmp_path, name, content, complaint):
    folder = copy_builtin_tokenizer(tmp_path)
    (folder / name).write_text(content, encoding="utf-8")
    with pytest.raises(TokenizerError, match=complaint):
        load_tokenizer(folder)


def test_shipped_builtin_files_are_what_the_script_builds():
    """tools/make_builtin_tokenizer.py must stay the source of the shipped files (vocabulary, merges, config)."""
    spec = importlib.util.spec_from_file_location("make_builtin_tokenizer", TOOLS_DIR / "make_builtin_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = json.loads(script.build_tokenizer().to_str())
    shipped = json.loads((BUILTIN_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    for part in ("model", "added_tokens", "pre_tokenizer", "post_processor", "decoder"):
        assert built[part] == shipped[part], part
    assert script.tokenizer_config() == json.loads((BUILTIN_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_token_bytes_join_to_what_tokenizers_decodes(builtin, reference, text):
    """Byte-level: every token's own bytes, joined, are the library's text; a piece of a character stays a piece."""
    ids = reference.encode(text, add_special_tokens=False).ids
    assert b"".join(builtin.token_bytes(i) for i in ids).decode() == reference.decode(ids)
    assert builtin.token_bytes(BUILTIN_SPECIAL_IDS["<|eot_id|>"]) == b"<|eot_id|>"


@pytest.mark.parity
@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_metaspace_token_bytes_join_to_what_transformers_decodes(llama2_tokenizer_json_dir, text):
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(llama2_tokenizer_json_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(llama2_tokenizer_json_dir)
    ids = theirs.encode(text, add_special_tokens=False)
    joined = b"".join(ours.token_bytes(i) for i in ids).decode()
    assert joined.removeprefix(" ") == theirs.decode(ids)  # the decoder drops the first "▁"'s space
