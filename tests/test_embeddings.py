"""Embeddings (`--runner pooling`): vectors equal HF transformers' pooled hidden states (last token and mean,
normalised) on a tiny Llama written by `save_pretrained` with sentence-transformers' pooling files, through
continuous batching (mixed lengths, prompts chunked over steps, a pool small enough to preempt), offline
(`LLM.embed`) and over HTTP with the official `openai` client; bad input is a 400 naming its field or the flag.

One pooling engine per pooling type for the whole file (tiny limits: 5 programs each); the server tests wrap the
LAST engine in a live server on 127.0.0.1, after the offline tests have used it.
"""

import asyncio
import base64
import contextlib
import json
import threading

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import openai  # noqa: E402
import torch  # noqa: E402

from jaxserve import LLM, PoolingParams  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR  # noqa: E402
from jaxserve.errors import ConfigError, InvalidRequestError  # noqa: E402
from jaxserve.openai.embeddings_answers import EmbeddingResponse  # noqa: E402
from jaxserve.openai.answers import ErrorResponse  # noqa: E402
from tests.hf_models import save_tiny_hf_llama  # noqa: E402
from tests.live_server import free_port  # noqa: E402

pytestmark = [pytest.mark.parity, pytest.mark.slow]

VOCAB = 512  # the built-in tokenizer's, so text inputs work
LIMITS = dict(tokenizer=BUILTIN_MODEL_DIR, runner="pooling", dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, use_tqdm_on_load=False)
# A batch of mixed lengths: 75 and 42 take several steps of 32 tokens (chunked prefill), 1 is a single token; with
# 7 usable pages the MEAN engine preempts one prompt on the way (the scheduler's order, checked below).
LENGTHS = (35, 1, 17, 42, 75, 5)
TOLERANCE = 1e-5
MODEL = "embedder"
TEXTS = ["Hello world", "The capital of France is", "a"]


def write_sentence_transformers(folder, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json and Pooling config beside the weights, pooling by `mode`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{m: m == mode for m in modes}, "include_prompt": True}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random HF Llama (float32) saved with last-token, normalised sentence-transformers pooling."""
    folder = tmp_path_factory.mktemp("embedder")
    model = save_tiny_hf_llama(folder, "llama31", vocab_size=VOCAB)
    write_sentence_transformers(folder, "pooling_mode_lasttoken", normalize=True)
    return folder, model


@pytest.fixture(scope="module")
def last_llm(checkpoint):
    """Pools as the checkpoint's files say: last token, normalised (prefix caching on)."""
    return LLM(model=checkpoint[0], **LIMITS)


@pytest.fixture(scope="module")
def mean_llm(checkpoint):
    """--pooler-config's MEAN over the checkpoint's LAST; a pool of 7 usable pages (112 tokens), so long prompts
    batched together run out of pages and are preempted."""
    return LLM(model=checkpoint[0], pooler_config={"pooling_type": "MEAN"}, num_kv_pages=8, **LIMITS)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in lengths]


def hf_embedding(model, token_ids, pooling: str, normalize: bool = True) -> np.ndarray:
    """HF's final-norm hidden states (last_hidden_state) of one prompt, pooled as sentence-transformers does."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([token_ids])).last_hidden_state[0].double().numpy()  # f64[L, hidden]
    vector = hidden[-1] if pooling == "LAST" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


def embed(llm, prompts, **kwargs):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kwargs)


# --- offline ------------------------------------------------------------------------------------------------------


def test_the_pooler_comes_from_the_checkpoint_or_the_flag(last_llm, mean_llm):
    assert (last_llm.config.pooler_config.pooling_type, last_llm.config.pooler_config.normalize) == ("LAST", True)
    assert (mean_llm.config.pooler_config.pooling_type, mean_llm.config.pooler_config.normalize) == ("MEAN", True)
    # A prefix found in the cache would leave its tokens out of a mean: MEAN turns prefix caching off.
    assert last_llm.config.enable_prefix_caching and not mean_llm.config.enable_prefix_caching


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_a_batch_of_mixed_lengths_equals_hf(checkpoint, last_llm, mean_llm, pooling):
    llm = last_llm if pooling == "LAST" else mean_llm
    prompts = prompts_of(LENGTHS)
    outputs = embed(llm, prompts)
    for prompt, output in zip(prompts, outputs):
        vector = np.asarray(output.outputs.embedding)
        assert output.outputs.hidden_size == 64 and output.prompt_token_ids == tuple(prompt)
        np.testing.assert_allclose(vector, hf_embedding(checkpoint[1], prompt, pooling), atol=TOLERANCE, rtol=0)
    stats = llm.engine.stats()
    # Embedding requests keep no pages once they finish (LAST's computed pages stay only as evictable cache).
    assert stats.num_pages_used == 0 and stats.num_running == stats.num_waiting == 0
    # The longest prompt took three steps' token budgets at least: it was computed chunk by chunk.
    assert max(LENGTHS) > 2 * llm.config.max_num_batched_tokens
    if pooling == "MEAN":
        assert stats.num_preemptions > 0  # preempted prompts restart their sums and still equal HF
    assert llm.engine.compiles_after_warmup == 0


def test_a_cached_prefix_gives_the_same_embedding(checkpoint, last_llm):
    prompt = prompts_of([70], seed=1)[0]
    before = last_llm.engine.stats().prefix_hit_tokens
    first, second = (embed(last_llm, [prompt])[0] for _ in range(2))
    assert last_llm.engine.stats().prefix_hit_tokens - before >= 64  # the second found four full pages cached
    expected = hf_embedding(checkpoint[1], prompt, "LAST")
    for output in (first, second):
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=TOLERANCE, rtol=0)


def test_pooling_params_turn_normalisation_off_and_truncate(checkpoint, last_llm):
    prompt = prompts_of([60], seed=2)[0]
    raw, cut = (embed(last_llm, [prompt], pooling_params=PoolingParams(use_activation=False))[0],
                embed(last_llm, [prompt], truncate_prompt_tokens=10)[0])
    np.testing.assert_allclose(raw.outputs.embedding, hf_embedding(checkpoint[1], prompt, "LAST", normalize=False),
                               atol=1e-4, rtol=1e-5)
    assert cut.prompt_token_ids == tuple(prompt[-10:])  # vLLM's truncation keeps the last tokens
    np.testing.assert_allclose(cut.outputs.embedding, hf_embedding(checkpoint[1], prompt[-10:], "LAST"),
                               atol=TOLERANCE, rtol=0)


def test_text_prompts_are_tokenized_as_the_tokenizer_does(checkpoint, last_llm):
    outputs = last_llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        ids = last_llm.tokenizer.encode(text, add_special_tokens=True)
        assert output.prompt_token_ids == tuple(ids)
        np.testing.assert_allclose(output.outputs.embedding, hf_embedding(checkpoint[1], ids, "LAST"),
                                   atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("prompt, params, param", [
    ({"prompt_token_ids": []}, PoolingParams(), "prompt"),
    ({"prompt_token_ids": [5, VOCAB]}, PoolingParams(), "prompt"),
    ({"prompt_token_ids": [5] * 129}, PoolingParams(), "prompt"),  # max_model_len is 128
    ({"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=32), "dimensions"),
    ({"prompt_token_ids": [5, 6]}, PoolingParams(priority=1), "priority"),  # first come, first served
])
def test_bad_prompts_are_refused_before_any_runs(last_llm, prompt, params, param):
    with pytest.raises(InvalidRequestError) as refused:
        last_llm.embed([{"prompt_token_ids": [7, 8]}, prompt], params, use_tqdm=False)
    assert refused.value.param == param
    assert not last_llm.engine.has_unfinished_requests()


def test_each_runner_refuses_the_others_methods(last_llm, tiny_llm):
    with pytest.raises(ConfigError, match="LLM.generate needs runner='generate'"):
        last_llm.generate("Hello")
    with pytest.raises(ConfigError, match="LLM.embed needs runner='pooling'"):
        tiny_llm.embed("Hello")


# --- over HTTP ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(llm, **server_settings):
    """`llm`'s engine behind the real app under Hypercorn on 127.0.0.1, on a thread; yields its base URL."""
    import hypercorn.asyncio
    import hypercorn.config

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.context import ServerContext

    port = free_port()
    context = ServerContext(engine=AsyncEngine(llm.engine), tokenizer=llm.tokenizer,
                            config=ServerConfig(port=port, served_model_names=(MODEL,), **server_settings),
                            max_model_len=llm.max_model_len, vocab_size=llm.model.config.vocab_size)
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(hypercorn.asyncio.serve(
        create_app(context), config, shutdown_trigger=lambda: asyncio.to_thread(stop.wait)),), daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):  # bounded: the engine is compiled already, the app starts in well under a second
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                    break
            stop.wait(0.05)
        yield base_url
    finally:
        stop.set()
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def server(last_llm):
    with serving(last_llm) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_the_openai_client_gets_hf_embeddings(checkpoint, last_llm, client):
    # The client asks for base64 unless told otherwise, and decodes it; float is asked for explicitly.
    for encoding in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        ids = [last_llm.tokenizer.encode(text, add_special_tokens=True) for text in TEXTS]
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
        for data, prompt in zip(response.data, ids):
            np.testing.assert_allclose(data.embedding, hf_embedding(checkpoint[1], prompt, "LAST"), atol=TOLERANCE,
                                       rtol=0)


@pytest.mark.parametrize("value", [[[5, 6, 7], [9] * 70], [5, 6, 7], "Hello world"])
def test_every_input_form_and_both_encodings_agree(checkpoint, last_llm, server, value):
    with httpx.Client(base_url=server, timeout=60) as http:
        answers = [http.post("/v1/embeddings", json={"model": MODEL, "input": value, "encoding_format": encoding})
                   for encoding in ("float", "base64")]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    floats, packed = (EmbeddingResponse.model_validate(a.json()) for a in answers)
    inputs = value if isinstance(value[0], list) else [value]
    for index, item in enumerate(inputs):
        ids = last_llm.tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else item
        decoded = np.frombuffer(base64.b64decode(packed.data[index].embedding), "<f4")
        assert np.array_equal(decoded, np.asarray(floats.data[index].embedding, np.float32))
        np.testing.assert_allclose(decoded, hf_embedding(checkpoint[1], ids, "LAST"), atol=TOLERANCE, rtol=0)


def test_truncate_prompt_tokens_keeps_the_last_tokens(checkpoint, server):
    prompt = prompts_of([300], seed=3)[0]  # longer than max_model_len (128)
    answer = httpx.post(server + "/v1/embeddings", json={"input": prompt, "truncate_prompt_tokens": 20}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 20
    np.testing.assert_allclose(answer.json()["data"][0]["embedding"],
                               hf_embedding(checkpoint[1], prompt[-20:], "LAST"), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("fields, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[5], []]}, 400, "input"),
    ({"input": [5, VOCAB]}, 400, "input"),  # outside the vocabulary
    ({"input": [5] * 129}, 400, "input"),  # longer than max_model_len
    ({"input": ["ok", "word " * 3000]}, 400, "input"),  # text too long, refused before tokenizing
    ({"input": 5}, 400, "input"),
    ({"input": "Hi", "dimensions": 32}, 400, "dimensions"),
    ({"input": "Hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ({"input": "Hi", "embed_dtype": "float16"}, 400, "embed_dtype"),
    ({"input": "Hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "Hi", "priority": 1}, 400, "priority"),  # first come, first served
    ({"input": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400, "messages"),
    ({"input": "Hi", "model": "gpt-9"}, 404, "model"),
    ({"input": "Hi", "user": "someone", "normalize": True, "use_activation": False}, 400, "use_activation"),
])
def test_bad_embedding_requests_name_their_field(server, fields, status, param):
    answer = httpx.post(server + "/v1/embeddings", json=fields, timeout=60)
    assert answer.status_code == status, answer.text
    assert ErrorResponse.model_validate(answer.json()).error.param == param


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"input": "Hi"}),
])
def test_a_pooling_server_refuses_generation_naming_the_route_and_flag(server, route, body):
    answer = httpx.post(server + route, json=body, timeout=60)
    message = ErrorResponse.model_validate(answer.json()).error.message
    assert answer.status_code == 400 and route in message and "--runner pooling" in message


def test_a_generating_server_refuses_embeddings_naming_the_flag(tiny_llm):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.context import ServerContext

    context = ServerContext(engine=AsyncEngine(tiny_llm.engine), tokenizer=tiny_llm.tokenizer, config=ServerConfig(),
                            max_model_len=tiny_llm.max_model_len, vocab_size=tiny_llm.model.config.vocab_size)

    async def post():
        answer = await create_app(context).test_client().post("/v1/embeddings", json={"input": "Hi"})
        return answer.status_code, await answer.get_json()

    status, body = asyncio.run(post())
    message = ErrorResponse.model_validate(body).error.message
    assert status == 400 and "/v1/embeddings" in message and "--runner pooling" in message


def test_the_server_compiled_nothing_after_warm_up(last_llm, server):
    assert last_llm.engine.compiles_after_warmup == 0
