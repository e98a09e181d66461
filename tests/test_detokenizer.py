"""The streaming detokenizer: its pieces always add up to the full decode, for both backends."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jaxserve.tokenizer import ByteStreamDetokenizer, IncrementalDetokenizer, load_tokenizer, streaming_detokenizer
from jaxserve.tokenizer.detokenizer import MAX_HELD_TOKENS, MAX_WINDOW_TOKENS
from tests.tokenizer_fixtures import BUILTIN_DIR, gpt2_byte_to_char, make_llama2_folder

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama2_folder(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer(BUILTIN_DIR)


@pytest.fixture(scope="module")
def llama2(sentencepiece_dir: Path):
    return load_tokenizer(sentencepiece_dir)


def byte_token_ids(tokenizer, backend: str) -> list[int]:
    """Ids of the single-byte tokens for bytes >= 0x80, the pieces of multi-byte characters."""
    if backend == "builtin":
        table = gpt2_byte_to_char()
        return [tokenizer.token_to_id(table[b]) for b in range(0x80, 0x100)]
    return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0x100)]


def token_streams(tokenizer, backend: str) -> st.SearchStrategy[list[int]]:
    """Random ids (special, byte-level and out-of-range included) mixed with encodings of random text."""
    any_id = st.integers(min_value=0, max_value=tokenizer.vocab_size)
    byte_id = st.sampled_from(byte_token_ids(tokenizer, backend))
    encoded = st.text(max_size=12).map(lambda text: tokenizer.encode(text, add_special_tokens=False))
    chunk = st.one_of(any_id.map(lambda i: [i]), byte_id.map(lambda i: [i]), encoded)
    return st.lists(chunk, max_size=12).map(lambda chunks: [i for c in chunks for i in c])


def stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True, kind=IncrementalDetokenizer) -> list[str]:
    """Push `ids` one by one, then flush; checks on the way that the returned text is always final."""
    detokenizer = kind(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    final = expected_text(tokenizer, ids, prompt_ids, skip_special_tokens)
    pieces = []
    for token_id in ids:
        pieces.append(detokenizer.push(token_id))
        assert final.startswith("".join(pieces)), "a piece was returned that the full decode does not have"
    pieces.append(detokenizer.flush())
    assert detokenizer.text == "".join(pieces)
    return pieces


def expected_text(tokenizer, ids, prompt_ids, skip_special_tokens) -> str:
    """What the generated ids add to the decoded prompt."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode([*prompt_ids, *ids], skip_special_tokens=skip_special_tokens)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text):]


# The byte stream applies to byte-level tokenizers only (the builtin one); the window decoder to every tokenizer.
DETOKENIZERS = [("builtin", IncrementalDetokenizer), ("llama2", IncrementalDetokenizer),
                ("builtin", ByteStreamDetokenizer)]


@pytest.mark.parametrize(("backend", "kind"), DETOKENIZERS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_add_up_to_the_full_decode(request, backend, kind, skip_special_tokens):
    tokenizer = request.getfixturevalue(backend)

    @PROPERTY_SETTINGS
    @given(ids=token_streams(tokenizer, backend))
    def check(ids):
        pieces = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens, kind=kind)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    check()


@pytest.mark.parametrize(("backend", "kind"), DETOKENIZERS)
def test_pieces_after_a_prompt_add_up(request, backend, kind):
    tokenizer = request.getfixturevalue(backend)
    prompt = st.text(min_size=1, max_size=30).map(tokenizer.encode)

    @PROPERTY_SETTINGS
    @given(prompt_ids=prompt, ids=token_streams(tokenizer, backend))
    def check(prompt_ids, ids):
        pieces = stream(tokenizer, ids, prompt_ids, kind=kind)
        assert "".join(pieces) == expected_text(tokenizer, ids, prompt_ids, True)

    check()


def test_a_character_split_between_prompt_and_output_is_completed_not_replaced(builtin):
    table = gpt2_byte_to_char()
    lead, *rest = [builtin.token_to_id(table[b]) for b in "日".encode()]
    prompt_ids = [*builtin.encode("a", add_special_tokens=False), lead]
    assert builtin.decode([*prompt_ids, *rest]) == "a日"
    detokenizer = ByteStreamDetokenizer(builtin, prompt_ids)
    assert [detokenizer.push(i) for i in rest] + [detokenizer.flush()] == ["", "日", ""]


def test_the_byte_stream_serves_only_tokenizers_that_decode_by_bytes(builtin, llama2):
    assert builtin.streams_token_bytes and not llama2.streams_token_bytes
    assert isinstance(streaming_detokenizer(builtin), ByteStreamDetokenizer)
    assert isinstance(streaming_detokenizer(llama2), IncrementalDetokenizer)


def test_first_generated_token_keeps_its_space_after_a_prompt(llama2):
    prompt_ids = llama2.encode("Hello")
    world = llama2.encode(" world", add_special_tokens=False)[1:]
    assert llama2.id_to_token(world[0]) == "▁world"
    assert llama2.decode(world) == "world", "sentencepiece alone drops the space"
    assert "".join(stream(llama2, world, prompt_ids)) == " world"
    assert "".join(stream(llama2, world)) == "world"


def test_multi_byte_character_is_held_until_complete(llama2):
    ids = llama2.encode("日", add_special_tokens=False)
    assert [llama2.id_to_token(i) for i in ids] == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]
    assert stream(llama2, ids) == ["", "", "", "日", ""]


def test_incomplete_character_comes_out_at_flush(builtin):
    lead_byte = builtin.token_to_id(gpt2_byte_to_char()[0xE3])
    hello = builtin.encode("Hello", add_special_tokens=False)
    assert stream(builtin, [*hello, lead_byte]) == ["Hello", "", "\ufffd"]


class BytesTokenizer:
    """Tokens that are raw byte strings, decoded like byte-level BPE: concatenated, invalid UTF-8 replaced."""

    all_special_ids = frozenset()

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")

    decode_valid = decode


def test_text_sharing_a_token_with_a_split_character_is_not_held():
    tokenizer = BytesTokenizer([b"ab\xe6", b"\x97", b"\xa5c"])
    assert stream(tokenizer, [0, 1, 2]) == ["ab", "", "\u65e5c", ""]


def test_trailing_replacement_characters_wait_for_the_next_character():
    """sentencepiece spells an incomplete character as one U+FFFD per byte, so none of a trailing run is final."""
    tokenizer = BytesTokenizer([b"\xff\xe6", b"\x97\xa5"])
    assert stream(tokenizer, [0, 1]) == ["", "\ufffd\u65e5", ""]


def test_skipped_special_tokens_return_nothing_and_keep_spacing(llama2):
    hello, world = llama2.encode("Hello", add_special_tokens=False), llama2.encode("world", add_special_tokens=False)
    ids = [*hello, 2, 1, *world]
    assert "".join(stream(llama2, ids)) == "Hello world" == llama2.decode(ids)
    assert "".join(stream(llama2, ids, skip_special_tokens=False)) == "Hello</s><s> world"


def test_work_per_token_is_bounded(builtin):
    """Each push decodes a window of bounded size, and about once: no re-decoding of the whole output."""
    calls = []

    class CountingTokenizer:
        vocab_size = builtin.vocab_size
        all_special_ids = builtin.all_special_ids

        def decode_valid(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return builtin.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = builtin.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(CountingTokenizer(), builtin.encode("prompt"))
    text = "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()
    assert text == builtin.decode(ids)
    assert max(calls) <= MAX_WINDOW_TOKENS + 1
    assert len(calls) <= 1.2 * len(ids)


def test_endless_undecodable_bytes_are_released(builtin):
    continuation_byte = builtin.token_to_id(gpt2_byte_to_char()[0x80])
    detokenizer = IncrementalDetokenizer(builtin)
    pushed = "".join(detokenizer.push(continuation_byte) for _ in range(3 * MAX_HELD_TOKENS))
    assert len(pushed) >= 2 * MAX_HELD_TOKENS
    assert pushed + detokenizer.flush() == "\ufffd" * 3 * MAX_HELD_TOKENS


@pytest.fixture(scope="module")
def llama2_tokenizer_json(tmp_path_factory, sentencepiece_dir):
    """Llama 2 as its repositories ship it: a Metaspace/ByteFallback tokenizer.json, converted by transformers."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama2_tokenizer_json")
    transformers.AutoTokenizer.from_pretrained(sentencepiece_dir).save_pretrained(folder)
    return load_tokenizer(folder)


@pytest.mark.parity
def test_llama2_tokenizer_json_streams_valid_text_exactly(llama2_tokenizer_json):
    """Only valid text: the ByteFallback decoder turns a whole run of byte tokens into U+FFFD when any of it is
    broken, so for arbitrary ids the full decode itself changes retroactively and no stream can match it."""
    tokenizer = llama2_tokenizer_json

    @PROPERTY_SETTINGS
    @given(prompt=st.text(max_size=20), generated=st.text(max_size=30))
    def check(prompt, generated):
        prompt_ids, all_ids = tokenizer.encode(prompt), tokenizer.encode(prompt + generated)
        assume(all_ids[:len(prompt_ids)] == prompt_ids)
        ids = all_ids[len(prompt_ids):]
        pieces = stream(tokenizer, ids, prompt_ids)
        assert "".join(pieces) == expected_text(tokenizer, ids, prompt_ids, True)

    check()


@pytest.mark.parity
def test_llama2_tokenizer_json_keeps_the_first_space(llama2_tokenizer_json):
    prompt_ids = llama2_tokenizer_json.encode("Hello")
    world = llama2_tokenizer_json.encode("Hello world")[len(prompt_ids):]
    assert llama2_tokenizer_json.id_to_token(world[0]) == "▁world"
    assert "".join(stream(llama2_tokenizer_json, world, prompt_ids)) == " world"
