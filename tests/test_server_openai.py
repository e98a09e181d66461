"""The live server through the official `openai` client: completions and chat, streamed or not, n, stop, seed,
logprobs, priorities, lm-evaluation-harness's scoring request and the tokenizer routes. Greedy answers must be
exactly what `LLM.generate` / `LLM.chat` give offline with the same engine settings (the server schedules by
priority, the offline oracle first come, first served)."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from typing import Annotated, Literal

import httpx
import openai
import pydantic
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.openai.bodies import completion_logprobs
from jaxserve.openai.requests import ToolDefinition
from jaxserve.openai.answers import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse,
                                     DetokenizeResponse, ErrorResponse, ModelCard, ModelList, TokenizeResponse)
from jaxserve.outputs import Logprob
from jaxserve.config import load_config
from tests.live_server import TINY_CONFIG, running_server
from tests.tokenizer_fixtures import BUILTIN_DIR

pytestmark = pytest.mark.slow

MODEL = "jaxserve-builtin"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One."}]}]
SMALL_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
LOGPROB_TOLERANCE = 1e-4  # the server batches prompts differently from the oracle: float32 sums may differ a little


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Scheduling by priority changes when requests run, never what they generate: every test here still holds.
    with running_server(tmp_path_factory.mktemp("server"), "--scheduling-policy", "priority") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oracle():
    """The offline engine with the server's settings (configs/tiny-cpu.yaml)."""
    return LLM.from_config(load_config(TINY_CONFIG, {}), use_tqdm_on_load=False)


def _greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def _offline(oracle, prompt, params):
    return oracle.generate(prompt, params, use_tqdm=False)[0]


# --- completions -------------------------------------------------------------------------------------------------


def test_greedy_completion_equals_llm_generate(client, oracle):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = _offline(oracle, PROMPT, _greedy(12))
    assert response.object == "text_completion" and response.model == MODEL
    assert response.choices[0].text == expected.outputs[0].text
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason


def test_streamed_completion_joins_to_the_non_streamed_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_completion_logprobs_join_to_the_non_streamed_ones(client):
    """text_offset runs on across events, as in the whole answer (each event does not restart at 0)."""
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, n=2)
    whole = client.completions.create(**request).choices
    streamed = [c.choices[0] for c in client.completions.create(**request, stream=True)]
    for index, answer in enumerate(whole):
        events = [c.logprobs for c in streamed if c.index == index and c.logprobs is not None]
        for field in ("tokens", "token_logprobs", "text_offset"):
            assert [x for event in events for x in getattr(event, field)] == getattr(answer.logprobs, field), field

def _usage_by_choice(events, tokens_of):
    """Per choice index: (tokens its events carried, the continuous usage each of its events reported);
    `tokens_of(choice, first)`: the generated tokens an event carries (`first`: the choice's first event)."""
    carried, reported = {}, {}
    for event in events:
        for choice in event.choices:
            first = choice.index not in carried
            carried[choice.index] = carried.get(choice.index, 0) + tokens_of(choice, first)
            reported.setdefault(choice.index, []).append((carried[choice.index], event.usage))
    return carried, reported


@pytest.mark.parametrize("echo", [False, True])
def test_continuous_usage_stats_count_each_choices_tokens_so_far(server, client, echo):
    """vLLM's continuous_usage_stats (what guidellm asks for): every event carries its choice's prompt tokens and the
    tokens generated for it so far; the last event still has the whole usage."""
    request = dict(model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=7, temperature=1, seed=5, n=2, logprobs=1,
                   echo=echo)
    whole = client.completions.create(**request)
    *events, last = client.completions.create(**request, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    prompt_tokens = [httpx.post(server.base_url + "/tokenize", json={"prompt": p}).json()["count"]
                     for p in request["prompt"]]

    def tokens_of(choice, first):  # with echo, a choice's first event starts with its prompt's tokens
        echoed = prompt_tokens[choice.index // 2] if echo and first else 0
        return len(choice.logprobs.tokens) - echoed

    carried, reported = _usage_by_choice(events, tokens_of)
    assert sorted(reported) == [0, 1, 2, 3]
    for index, steps in reported.items():
        for so_far, usage in steps:
            assert usage.prompt_tokens == prompt_tokens[index // 2]
            assert usage.completion_tokens == so_far and usage.total_tokens == so_far + usage.prompt_tokens
    assert sum(carried.values()) == whole.usage.completion_tokens == last.usage.completion_tokens
    assert last.choices == [] and last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_continuous_usage_stats_in_chat_start_at_zero_with_the_role(client):
    request = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**request)
    first, *events, last = client.chat.completions.create(**request, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    assert first.choices[0].delta.role == "assistant" and first.usage.completion_tokens == 0
    carried, reported = _usage_by_choice(events, lambda c, _: len(c.logprobs.content) if c.logprobs else 0)
    assert [usage.completion_tokens for _, usage in reported[0]] == [so_far for so_far, _ in reported[0]]
    assert carried[0] == whole.usage.completion_tokens == last.usage.completion_tokens
    assert {usage.prompt_tokens for _, usage in reported[0]} == {whole.usage.prompt_tokens}


def test_continuous_usage_needs_include_usage(client):
    """As in vLLM: continuous_usage_stats alone adds nothing."""
    events = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert events and all(event.usage is None and event.choices for event in events)


def test_guidellm_benchmark_run_has_no_errored_request(server, tmp_path):
    """guidellm (the serving benchmark vLLM recommends) streams /v1/completions with every request field it sends
    (continuous_usage_stats, ignore_eos, stop null) and reads the usage of each event: every request succeeds and
    its output tokens are the ones asked for."""
    scenario = {"metadata": {"name": "smoke"}, "spec": {
        "backend": {"kind": "openai_http", "target": server.base_url, "model": MODEL,
                    "request_format": "/v1/completions"},
        "profile": {"kind": "concurrent", "streams": 3},
        "tokenizer": {"kind": "huggingface_auto", "model": str(BUILTIN_DIR)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 24, "output_tokens": 6}],
        "constraints": [{"kind": "max_requests", "count": 9}, {"kind": "max_duration", "seconds": 120}]}}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(tmp_path / "scenario.json"),
                          "--output", f"kind=json,path={report}"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    requests = benchmark["requests"]
    assert requests["errored"] == [] and requests["incomplete"] == []
    assert len(requests["successful"]) == 9
    assert {r["output_metrics"]["text_tokens"] for r in requests["successful"]} == {6}


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_with_logprobs_joins_to_the_whole_answer(client, max_tokens):
    """As vLLM: each choice's first event starts with its prompt and the prompt's log-probabilities (max_tokens 0:
    the prompt alone, scored, which lm-evaluation-harness-style scoring streams too)."""
    request = dict(model=MODEL, prompt=[PROMPT, "Hi there"], max_tokens=max_tokens, temperature=0, logprobs=2,
                   echo=True, n=2)
    whole = client.completions.create(**request).choices
    streamed = [c.choices[0] for c in client.completions.create(**request, stream=True)]
    for answer in whole:
        events = [c for c in streamed if c.index == answer.index]
        assert "".join(c.text for c in events) == answer.text
        assert events[-1].finish_reason == answer.finish_reason == "length"
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            joined = [x for c in events if c.logprobs is not None for x in getattr(c.logprobs, field)]
            assert joined == getattr(answer.logprobs, field), field
        assert answer.logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token


def test_completion_n_2_gives_two_indexed_choices(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1, seed=3, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert 2 <= response.usage.completion_tokens <= 12


def test_completion_stop_string_ends_the_text_as_offline(client, oracle):
    full = _offline(oracle, PROMPT, _greedy(16)).outputs[0].text
    stop = full[4:6]
    assert stop.strip(), f"greedy text too short to pick a stop string from: {full!r}"
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    expected = _offline(oracle, PROMPT, _greedy(16, stop=[stop])).outputs[0]
    choice = response.choices[0]
    assert choice.text == expected.text and stop not in choice.text and full.startswith(choice.text)
    assert choice.finish_reason == "stop"


def test_same_seed_same_text_and_other_seeds_differ(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1,
                                         seed=seed).choices[0].text

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_completion_logprobs_match_offline(client, oracle):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    expected = _offline(oracle, PROMPT, _greedy(6, logprobs=2)).outputs[0]
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == response.usage.completion_tokens == len(expected.token_ids)
    for token, logprob, top, (token_id, candidates) in zip(logprobs.tokens, logprobs.token_logprobs,
                                                           logprobs.top_logprobs,
                                                           zip(expected.token_ids, expected.logprobs)):
        assert logprob == pytest.approx(candidates[token_id].logprob, abs=LOGPROB_TOLERANCE)
        assert token in top and 1 <= len(top) <= 3


# --- chat --------------------------------------------------------------------------------------------------------


def test_greedy_chat_equals_llm_chat(client, oracle):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    expected = oracle.chat(CHAT, _greedy(10), use_tqdm=False)[0]
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == expected.outputs[0].text
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_priorities_are_honoured_and_change_no_token(client, oracle):
    """vLLM's `priority` (an extra field for the official client), under --scheduling-policy priority: requests of
    mixed priorities sent together each get exactly the offline greedy answer."""
    expected = _offline(oracle, PROMPT, _greedy(12)).outputs[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda priority: client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"priority": priority}),
            [-3, 0, 2, 7]))
    assert [answer.choices[0].text for answer in answers] == [expected] * 4
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"priority": -1})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == oracle.chat(CHAT, _greedy(10), use_tqdm=False)[0].outputs[0].text


def test_chat_without_max_tokens_may_fill_the_context(client, oracle):
    messages = [{"role": "user", "content": "Hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    prompt_len = len(oracle.chat(messages, _greedy(1), use_tqdm=False)[0].prompt_token_ids)
    # The random model rarely says EOS: it either stops early or runs to the end of the context, never beyond.
    assert response.usage.prompt_tokens == prompt_len
    assert response.usage.total_tokens <= oracle.max_model_len
    assert response.choices[0].finish_reason == "stop" or response.usage.total_tokens == oracle.max_model_len


def test_streamed_chat_starts_with_the_role_and_joins_to_the_non_streamed_text(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in content if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[0].message.content
        assert [c.finish_reason for c in mine][-1] == whole.choices[0].finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_chat_n_stop_and_seed(client):
    def sample(seed, **kwargs):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1, seed=seed,
                                              **kwargs)

    first, again, other = sample(5, n=2), sample(5, n=2), sample(50, n=2)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert [c.message.content for c in first.choices] != [c.message.content for c in other.choices]
    text = first.choices[0].message.content
    stop = text[2:4]
    assert stop.strip(), f"sampled text too short to pick a stop string from: {text!r}"
    stopped = sample(5, stop=stop).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.content == text[:text.index(stop)]


def test_chat_logprobs_with_top_3_match_offline(client, oracle):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=3)
    expected = oracle.chat(CHAT, _greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == len(expected.token_ids)
    for entry, token_id, candidates in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(candidates[token_id].logprob, abs=LOGPROB_TOLERANCE)
        assert len(entry.top_logprobs) == 3 and entry.token in [t.token for t in entry.top_logprobs]
        assert entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)


@pytest.mark.parametrize("top", [0, 1])
def test_chat_top_logprobs_lists_exactly_n_and_each_tokens_own_bytes(client, top):
    """As OpenAI: N alternatives whether or not the sampled token is among them (sampling at temperature 1 often
    picks one outside the top 1), and `bytes` the token's bytes, which join to the text even where a token holds
    part of a character."""
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=1.0, seed=7,
                                              logprobs=True, top_logprobs=top,
                                              extra_body={"skip_special_tokens": False})
    content = response.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == top for entry in content)
    assert bytes(b for entry in content for b in entry.bytes).decode(errors="replace") == (
        response.choices[0].message.content)


def test_streamed_chat_logprobs_cover_every_token(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]


# --- lm-evaluation-harness ---------------------------------------------------------------------------------------


def _lm_eval_scoring(server, prompts, max_tokens):
    """The body lm-evaluation-harness's local-completions sends for loglikelihood requests."""
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "temperature": 0, "seed": 1234}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def scored_prompts(oracle):
    """Pre-tokenized prompts (no BOS, as lm-eval sends them) and their offline prompt log-probabilities.

    The last one ends with the model's own greedy continuation, so lm-eval's greedy check meets both answers.
    """
    text = oracle.tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    continuation = _offline(oracle, {"prompt_token_ids": text}, _greedy(8)).outputs[0].token_ids
    prompts = [text, list(range(40, 60)), text + list(continuation)]
    expected = oracle.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return prompts, expected


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(server, scored_prompts, max_tokens):
    prompts, expected = scored_prompts
    body = _lm_eval_scoring(server, prompts, max_tokens)
    assert len(body["choices"]) == len(prompts)
    greedy_checks = set()
    for choice, prompt, offline in zip(body["choices"], prompts, expected):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][0] is None  # nothing predicts the first token
        for position in range(1, len(prompt)):
            scored = offline.prompt_logprobs[position][prompt[position]]
            token_logprob, top = logprobs["token_logprobs"][position], logprobs["top_logprobs"][position]
            assert token_logprob == pytest.approx(scored.logprob, abs=LOGPROB_TOLERANCE)
            assert logprobs["tokens"][position] in top
            # lm-eval's greedy check: the token's log-probability is the largest listed
            greedy = token_logprob >= max(top.values()) - 1e-6
            assert greedy == (scored.rank == 1)
            greedy_checks.add(greedy)
    assert greedy_checks == {True, False}
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)


def test_legacy_top_logprobs_keep_the_likelier_of_tokens_spelled_alike():
    # Byte pieces of a multi-byte character all decode to U+FFFD; lm-eval's greedy check compares log-probabilities
    candidates = {7: Logprob(-0.5, 1, "\ufffd"), 9: Logprob(-2.0, 2, "a"), 8: Logprob(-3.0, 3, "\ufffd")}
    logprobs = completion_logprobs([8], [candidates])
    assert logprobs["top_logprobs"] == [{"\ufffd": -0.5, "a": -2.0}]
    assert logprobs["token_logprobs"][0] < max(logprobs["top_logprobs"][0].values())  # so token 8 is not greedy


# --- tokenizer routes --------------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server, oracle):
    tokenizer = oracle.tokenizer
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with_bos = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert with_bos == {"tokens": tokenizer.encode(PROMPT), "count": len(tokenizer.encode(PROMPT)),
                            "max_model_len": oracle.max_model_len}
        bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
        chat = http.post("/tokenize", json={"messages": CHAT}).json()
        assert tuple(chat["tokens"]) == oracle.chat(CHAT, _greedy(1), use_tqdm=False)[0].prompt_token_ids
        assert chat["tokens"].count(tokenizer.bos_token_id) == 1  # the template writes BOS; encoding adds none
        text = http.post("/detokenize", json={"tokens": with_bos["tokens"]}).json()
        assert text == {"prompt": tokenizer.decode(with_bos["tokens"], skip_special_tokens=False)}
        assert http.post("/tokenize", json={"prompt": text["prompt"], "add_special_tokens": False}).json()["tokens"] \
            == with_bos["tokens"]


def test_tokenize_counts_prompts_and_conversations_past_the_context_alike(server, oracle):
    """One rule for both forms, as vLLM's /tokenize: counted whatever their length (the conversation used to be
    refused at max_model_len tokens while a prompt of any length was counted)."""
    long_text = "word " * oracle.max_model_len
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        prompt = http.post("/tokenize", json={"prompt": long_text})
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": long_text}]})
    assert prompt.status_code == chat.status_code == 200, chat.text
    assert prompt.json()["count"] > oracle.max_model_len and chat.json()["count"] > prompt.json()["count"]
    assert chat.json()["tokens"] == list(oracle.tokenizer.encode(oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": long_text}], add_generation_prompt=True), add_special_tokens=False))


def test_tokenizer_info_has_what_lm_eval_reads(server, oracle):
    info = httpx.get(server.base_url + "/tokenizer_info", timeout=30).json()
    tokenizer = oracle.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template.source
    assert info["model_max_length"] == oracle.max_model_len and info["vocab_size"] == tokenizer.vocab_size


# --- every answer as /openapi.json declares it ---------------------------------------------------------------------


# (path, body, model of the JSON answer or of each streamed event)
DECLARED_ANSWERS = [
    ("/v1/completions", {"prompt": [PROMPT, "Hi"], "max_tokens": 3, "n": 2, "logprobs": 2, "echo": True},
     CompletionResponse),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "stream": True,
                         "stream_options": {"include_usage": True}}, CompletionChunk),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2},
     ChatCompletionResponse),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "stream": True,
                              "stream_options": {"include_usage": True}}, ChatCompletionChunk),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True, "echo": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, CompletionChunk),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     ChatCompletionChunk),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 30, "tools": [SMALL_TOOL], "tool_choice": "required"},
     ChatCompletionResponse),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 30, "tools": [SMALL_TOOL], "tool_choice": "required",
                              "stream": True}, ChatCompletionChunk),
    ("/tokenize", {"prompt": PROMPT}, TokenizeResponse),
    ("/tokenize", {"messages": CHAT}, TokenizeResponse),
    ("/detokenize", {"tokens": [5, 6, 7]}, DetokenizeResponse),
    ("/v1/models", None, ModelList),
    (f"/v1/models/{MODEL}", None, ModelCard),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 0}, ErrorResponse),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True, "logit_bias": {"100000": 1}},
     ErrorResponse),
]


@pytest.mark.parametrize("path, body, model", DECLARED_ANSWERS,
                         ids=[f"{p} {m.__name__}" for p, _, m in DECLARED_ANSWERS])
def test_answers_are_the_declared_models(server, path, body, model):
    """Exactly the declared fields (the models forbid others), streamed events one by one."""
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        response = http.get(path) if body is None else http.post(path, json=body)
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        for event in events[:-1]:
            model.model_validate_json(event)
    else:
        model.model_validate_json(response.content)


# --- structured output -----------------------------------------------------------------------------------------


class Point(pydantic.BaseModel):
    x: Annotated[int, pydantic.Field(ge=0, le=9)]
    y: Annotated[int, pydantic.Field(ge=0, le=9)]
    label: Annotated[str, pydantic.Field(max_length=6)]


def test_chat_completions_parse_returns_the_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Point, max_tokens=60,
                                               temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Point)
    assert Point.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_guided_choice_joins_to_one_choice(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5,
                                       stream=True, extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    pieces = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert "".join(p.text for p in pieces) in ("Paris", "Lyon", "Nice") and pieces[-1].finish_reason == "stop"


def test_json_object_and_vllm_structured_outputs(client):
    # Any object: the random model may stay inside a string until max_tokens, so only a finished one must parse.
    anything = client.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"},
                                              max_tokens=60, temperature=1.0, seed=1, n=4)
    assert all(c.message.content.startswith("{") for c in anything.choices)
    finished = [c.message.content for c in anything.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    coded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", coded.choices[0].text)


# --- tool calls --------------------------------------------------------------------------------------------------


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]
    days: Annotated[int, pydantic.Field(ge=1, le=7)]


WEATHER_TOOL = openai.pydantic_function_tool(Weather)
# The server renders a tool in its declared field order (type, function: name, description, parameters, strict).
RENDERED_TOOL = ToolDefinition.model_validate(WEATHER_TOOL).model_dump(exclude_none=True)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def test_a_forced_call_parses_into_the_pydantic_model_and_the_conversation_goes_on(client, oracle):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = completion.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    history = [*ASK, {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                            max_tokens=8, temperature=0)
    expected = oracle.chat(history, _greedy(8), use_tqdm=False, tools=[RENDERED_TOOL])[0].outputs[0].text
    assert answer.choices[0].message.content == expected and answer.choices[0].message.tool_calls is None


def test_streamed_calls_accumulate_to_the_calls_answered_whole(client):
    request = {"model": MODEL, "messages": ASK, "tools": [WEATHER_TOOL], "temperature": 1.0, "seed": 11,
               "max_tokens": 60, "tool_choice": {"type": "function", "function": {"name": "Weather"}}}
    whole = client.chat.completions.create(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    # OpenAI's role event says content null where the answer must call: accumulated, it is the whole answer's null.
    assert streamed.message.content is None and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert Weather.model_validate_json(whole.message.tool_calls[0].function.arguments)


def test_with_tool_choice_auto_plain_text_stays_content(client, oracle):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], max_tokens=8,
                                            temperature=0).choices[0]
    expected = oracle.chat(ASK, _greedy(8), use_tqdm=False, tools=[RENDERED_TOOL])[0].outputs[0]
    assert not expected.text.lstrip().startswith("{")
    assert (answer.message.content, answer.message.tool_calls, answer.finish_reason) == (expected.text, None,
                                                                                         expected.finish_reason)
