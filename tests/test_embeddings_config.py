"""The pooling runner's settings and protocol, without an engine: `--runner` / `--convert` / `--pooler-config` as
vLLM names them, sentence-transformers' pooling files, PoolingParams, the /v1/embeddings body's inputs and answer."""

import base64
import json

import numpy as np
import pytest

from jaxserve.config import FIELD_NAMES, EngineConfig, load_config
from jaxserve.errors import ConfigError, InvalidRequestError
from jaxserve.openai.embeddings_answers import EmbeddingResponse, embedding_body
from jaxserve.openai.embeddings_requests import EmbeddingRequestBody, embedding_inputs, pooling_params_from_body
from jaxserve.openai.schema import parse_body
from jaxserve.outputs import EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from jaxserve.pooler_config import PoolerConfig, sentence_transformers_pooler
from jaxserve.pooling_params import PoolingParams
from jaxserve.tokenizer import load_tokenizer
from tests.tokenizer_fixtures import BUILTIN_DIR

ST_TYPE = "sentence_transformers.models."


def write_modules(folder, *types, pooling=None):
    """modules.json listing `types` (short names), with a Pooling module whose config sets `pooling` modes."""
    modules = [{"idx": i, "name": str(i), "path": "1_Pooling" if t == "Pooling" else "", "type": ST_TYPE + t}
               for i, t in enumerate(types)]
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))


# --- engine settings ----------------------------------------------------------------------------------------------


def test_runner_and_convert_resolve_as_vllms():
    assert EngineConfig().runner == "generate" and not EngineConfig().pooling
    assert EngineConfig(runner="pooling").pooling and EngineConfig(convert="embed").runner == "pooling"
    assert EngineConfig(runner="pooling", convert="embed").pooling


@pytest.mark.parametrize("settings, message", [
    (dict(runner="embed"), "runner (--runner) must be one of auto, generate, pooling"),
    (dict(convert="classify"), "classify and reward conversions are not implemented"),
    (dict(runner="generate", convert="embed"), "add --runner pooling"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config (--pooler-config) applies to the pooling runner"),
    (dict(runner="pooling", convert="none"), "needs convert (--convert) embed"),
    (dict(runner="pooling", enable_lora=True), "enable_lora (--enable-lora) does not combine with runner"),
    (dict(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config (--speculative-config) does not combine"),
    (dict(runner="pooling", pooler_config="{not json"), "--pooler-config) is not valid JSON"),
    (dict(runner="pooling", pooler_config={"pooling_type": "CLS"}), "CLS, ALL and STEP pooling are not implemented"),
    (dict(runner="pooling", pooler_config={"dimensions": 32}), "dimensions is not supported"),
    (dict(runner="pooling", pooler_config={"softmax": True}), "unknown key 'softmax'"),
    (dict(runner="pooling", pooler_config={"normalize": True, "use_activation": False}), "disagree"),
])
def test_bad_settings_name_the_flag(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings)


def test_the_flags_parse_into_the_config():
    from jaxserve.cli import _build_parser

    args = _build_parser().parse_args(["serve", "--runner", "pooling", "--convert", "embed", "--pooler-config",
                                       '{"pooling_type": "MEAN", "use_activation": false}'])
    config = load_config(None, {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    assert config.pooling and config.pooler_config == PoolerConfig("MEAN", False)


def test_the_pooler_takes_the_flag_then_the_checkpoint_then_the_defaults():
    checkpoint = PoolerConfig("MEAN", False)
    assert EngineConfig(runner="pooling").with_pooler(None).pooler_config == PoolerConfig("LAST", True)
    assert EngineConfig(runner="pooling").with_pooler(checkpoint).pooler_config == checkpoint
    flagged = EngineConfig(runner="pooling", pooler_config='{"normalize": true}').with_pooler(checkpoint)
    assert flagged.pooler_config == PoolerConfig("MEAN", True)
    # MEAN turns prefix caching off (a cached prefix would leave tokens out of the mean); LAST keeps it.
    assert not flagged.enable_prefix_caching
    assert EngineConfig(runner="pooling").with_pooler(PoolerConfig("LAST")).enable_prefix_caching
    assert EngineConfig().with_pooler(checkpoint) == EngineConfig()  # a generating engine is left alone


def test_sentence_transformers_files_give_the_pooler(tmp_path):
    assert sentence_transformers_pooler(tmp_path) is None  # no modules.json
    write_modules(tmp_path, "Transformer", "Pooling", "Normalize", pooling={"pooling_mode_mean_tokens": True,
                                                                            "pooling_mode_cls_token": False})
    assert sentence_transformers_pooler(tmp_path) == PoolerConfig("MEAN", True)
    other = tmp_path / "last"
    other.mkdir()
    write_modules(other, "Transformer", "Pooling", pooling={"pooling_mode_lasttoken": True})
    assert sentence_transformers_pooler(other) == PoolerConfig("LAST", False)  # no Normalize module


@pytest.mark.parametrize("types, pooling, message", [
    (("Transformer", "Pooling", "Dense"), {"pooling_mode_lasttoken": True}, "Dense, which this engine does not"),
    (("Transformer", "Pooling"), {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    (("Transformer", "Pooling"), {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, "exactly one"),
    (("Transformer", "Pooling"), None, "is missing"),
])
def test_sentence_transformers_modules_this_engine_would_not_apply_are_refused(tmp_path, types, pooling, message):
    write_modules(tmp_path, *types, pooling=pooling)
    with pytest.raises(ConfigError, match=message):
        sentence_transformers_pooler(tmp_path)


# --- per-request settings -----------------------------------------------------------------------------------------


def test_truncation_keeps_the_last_tokens_unless_told_otherwise():
    ids = tuple(range(10))
    assert PoolingParams(truncate_prompt_tokens=3).truncated(ids, 8) == (7, 8, 9)
    assert PoolingParams(truncate_prompt_tokens=3, truncation_side="right").truncated(ids, 8) == (0, 1, 2)
    assert PoolingParams(truncate_prompt_tokens=-1).truncated(ids, 8) == ids[2:]  # max_model_len
    assert PoolingParams().truncated(ids, 8) == ids  # too long: the engine refuses it
    assert PoolingParams(normalize=False).use_activation is False  # vLLM's older name


@pytest.mark.parametrize("settings, param", [
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncation_side="middle"), "truncation_side"),
    (dict(dimensions=0), "dimensions"),
    (dict(normalize=True, use_activation=False), "use_activation"),
])
def test_bad_pooling_params_name_their_field(settings, param):
    with pytest.raises(InvalidRequestError) as refused:
        PoolingParams(**settings)
    assert refused.value.param == param


# --- the /v1/embeddings protocol ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUILTIN_DIR)


def test_the_four_input_forms(tokenizer):
    hello = tuple(tokenizer.encode("Hello", add_special_tokens=True))
    assert [p.token_ids for p in embedding_inputs("Hello", tokenizer, True)] == [hello]
    assert [p.token_ids for p in embedding_inputs(["Hello", "Hello"], tokenizer, True)] == [hello, hello]
    assert [p.token_ids for p in embedding_inputs([5, 6], tokenizer, True)] == [(5, 6)]
    assert [p.token_ids for p in embedding_inputs([[5], [6, 7]], tokenizer, True)] == [(5,), (6, 7)]
    assert embedding_inputs("Hello", tokenizer, False)[0].token_ids == tuple(tokenizer.encode("Hello",
                                                                                              add_special_tokens=False))


@pytest.mark.parametrize("value", ["", [], ["a", ""]])
def test_empty_inputs_name_input(tokenizer, value):
    with pytest.raises(InvalidRequestError) as refused:
        embedding_inputs(value, tokenizer, True)
    assert refused.value.param == "input"


def test_the_body_gives_the_pooling_params():
    body = parse_body(EmbeddingRequestBody, {"input": "x", "truncate_prompt_tokens": 4, "use_activation": False,
                                             "user": "u", "encoding_format": "base64"})
    assert pooling_params_from_body(body) == PoolingParams(truncate_prompt_tokens=4, use_activation=False)
    with pytest.raises(InvalidRequestError) as refused:
        parse_body(EmbeddingRequestBody, {"input": "x", "dimensions": 8})
    assert refused.value.param == "dimensions"


def test_the_answer_in_floats_and_in_base64():
    vectors = [np.array([0.5, -1.25, 3.0e-8], np.float32), np.array([1.0, 0.0, -0.0], np.float32)]
    outputs = [PoolingRequestOutput(str(i), PoolingOutput(v), (1,) * (i + 2), True) for i, v in enumerate(vectors)]
    floats, packed = (EmbeddingResponse.model_validate(embedding_body(outputs, "m", fmt)) for fmt in ("float",
                                                                                                     "base64"))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 5
    for vector, as_floats, as_base64 in zip(vectors, floats.data, packed.data):
        assert as_floats.embedding == vector.tolist()
        assert np.array_equal(np.frombuffer(base64.b64decode(as_base64.embedding), "<f4"), vector)
    assert EmbeddingRequestOutput.from_base(outputs[0]).outputs.embedding == vectors[0].tolist()
