"""LoRA adapters over HTTP: --lora-modules, a request's `model` naming an adapter, /v1/models, loading and
unloading while serving, and the refusals, through the official `openai` client against the live server. An
adapter's greedy answer must be what `LLM.generate` gives offline with the same adapter."""

import json
from pathlib import Path

import httpx
import openai
import pytest

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.random_lora import write_random_lora_adapter
from jaxserve.config import load_config
from jaxserve.errors import ConfigError, ModelNotFoundError
from jaxserve.model.config import LlamaConfig
from jaxserve.server.api_errors import as_api_error
from jaxserve.server.config import ServerConfig, parse_lora_module
from tests.live_server import TINY_CONFIG, running_server

pytestmark = pytest.mark.slow

MODEL = "jaxserve-builtin"
KEY = "sk-lora-test"
PROMPT = "The capital of France is"
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("server_adapters")
    config = LlamaConfig.from_hf_dict(json.loads((Path(BUILTIN_MODEL_DIR) / "config.json").read_text()))
    write_random_lora_adapter(work / "qv", config, rank=4, projections=("q_proj", "v_proj", "down_proj"))
    write_random_lora_adapter(work / "mlp", config, rank=8, projections=("gate_proj", "up_proj", "o_proj"), seed=3)
    write_random_lora_adapter(work / "wide", config, rank=16)
    (work / "broken").mkdir()
    (work / "broken" / "adapter_config.json").write_text("{not json")
    return {name: work / name for name in ("qv", "mlp", "wide", "broken")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    flags = (*LORA_FLAGS, "--lora-modules", f"qv={adapters['qv']}", "--api-key", KEY)
    with running_server(tmp_path_factory.mktemp("server"), *flags) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oracle():
    """The offline engine with the server's settings."""
    return LLM.from_config(load_config(TINY_CONFIG, {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}),
                           use_tqdm_on_load=False)


def offline_text(oracle, lora: LoRARequest | None) -> str:
    params = SamplingParams(max_tokens=12, temperature=0)
    return oracle.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_a_request_naming_an_adapter_runs_with_it(client, oracle, adapters):
    answer = client.completions.create(model="qv", prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.model == "qv"
    assert answer.choices[0].text == offline_text(oracle, LoRARequest("qv", 1, str(adapters["qv"])))
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert base.choices[0].text == offline_text(oracle, None) != answer.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert cards["qv"].parent == MODEL and cards["qv"].root == str(adapters["qv"])
    assert cards[MODEL].parent is None
    assert client.models.retrieve("qv").id == "qv"


def test_an_adapter_loaded_while_serving_serves_chat_and_is_unloaded(client, http, oracle, adapters):
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert loaded.status_code == 200 and "mlp" in loaded.text
    streamed = client.completions.create(model="mlp", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text == offline_text(oracle, LoRARequest("mlp", 9, str(adapters["mlp"])))
    chat = client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "mlp"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as gone:
        client.completions.create(model="mlp", prompt=PROMPT, max_tokens=2)
    assert gone.value.body["param"] == "model"
    assert "mlp" not in {card.id for card in client.models.list().data}
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"lora_name": "wide", "lora_path": "wide"}, "lora_path", "rank"),
    ({"lora_name": "broken", "lora_path": "broken"}, "lora_path", "adapter_config.json"),
    ({"lora_name": "nowhere", "lora_path": "/no/such/folder"}, "lora_path", "does not exist"),
    ({"lora_name": "qv", "lora_path": "mlp"}, "lora_name", "already been loaded"),
    ({"lora_name": MODEL, "lora_path": "mlp"}, "lora_name", "already been loaded"),
    ({"lora_name": "x"}, "lora_path", "required"),
])
def test_bad_loads_are_400s_naming_the_problem_and_change_nothing(http, adapters, body, param, words):
    body = {**body, **({"lora_path": str(adapters[body["lora_path"]])} if body.get("lora_path") in adapters else {})}
    before = http.get("/v1/models").json()
    answer = http.post("/v1/load_lora_adapter", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert http.get("/v1/models").json()["data"] == before["data"]


def test_an_unknown_model_is_a_404_listing_the_adapters(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert missing.value.body["param"] == "model" and "'qv'" in missing.value.body["message"]


def test_adapter_routes_need_the_api_key(server, adapters):
    answer = httpx.post(server.base_url + "/v1/load_lora_adapter",
                        json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert answer.status_code == 401


@pytest.mark.parametrize(("entry", "expected"), [
    ("qv=/models/qv", ("qv", "/models/qv")),
    ('{"name": "qv", "path": "/models/qv", "base_model_name": "llama"}', ("qv", "/models/qv")),
    ("qv=/a=b", ("qv", "/a=b")),
])
def test_lora_modules_take_both_of_vllms_forms(entry, expected):
    assert parse_lora_module(entry) == expected


@pytest.mark.parametrize("entry", ["qv", "=path", "qv=", '{"name": "qv"}', '{"name": "qv", "path": 1}',
                                   '{"name": "qv", "path": "p", "rank": 8}', "{broken"])
def test_malformed_lora_modules_are_refused(entry):
    with pytest.raises(ConfigError, match="--lora-modules"):
        parse_lora_module(entry)


def test_lora_module_names_must_be_distinct_from_each_other_and_the_model():
    with pytest.raises(ConfigError, match="'a'"):
        ServerConfig(lora_modules=(("a", "x"), ("a", "y")))
    with pytest.raises(ConfigError, match=MODEL):
        ServerConfig(lora_modules=((MODEL, "x"),))



def test_an_adapter_unloaded_before_its_request_reached_the_engine_is_a_404_naming_model():
    error = as_api_error(ModelNotFoundError("the LoRA adapter 'a' was unloaded", param="model"))
    assert (error.status, error.kind, error.param) == (404, "not_found_error", "model")
