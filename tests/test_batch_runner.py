"""`run-batch`: OpenAI batch JSONL in, one result per line out; bodies validate as the official client's types."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from jaxserve import SamplingParams
from jaxserve.entrypoints.batch_runner import BatchModels, run_batch
from jaxserve.entrypoints.llm import LLM


def _line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture
def batch_results(tiny_llm, tmp_path):
    lines = [
        _line("text", "/v1/completions", {"model": "tiny", "prompt": "Hello world", "max_tokens": 5,
                                          "temperature": 0}),
        "{not json",
        _line("ids", "/v1/completions", {"prompt": [507, 40, 41], "max_tokens": 4, "temperature": 0, "logprobs": 2}),
        _line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                               "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2}),
        _line("bad-url", "/v1/embeddings", {"input": "x"}),
        _line("too-long", "/v1/completions", {"prompt": list(range(5, 100)), "max_tokens": 1}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    counts = run_batch(tiny_llm, source, target, "tiny")
    return counts, [json.loads(line) for line in target.read_text().splitlines()]


def test_every_line_gets_a_result_in_order(batch_results):
    counts, results = batch_results
    assert counts == (3, 4)
    assert [r["custom_id"] for r in results] == ["text", "line-2", "ids", "bad-temp", "chat", "bad-url", "too-long"]


def test_bad_lines_get_openai_errors_and_spare_the_rest(batch_results):
    _, results = batch_results
    errors = {r["custom_id"]: r["response"] for r in results if r["response"]["status_code"] != 200}
    assert set(errors) == {"line-2", "bad-temp", "bad-url", "too-long"}
    assert errors["bad-temp"]["body"]["error"]["param"] == "temperature"
    assert "max_model_len" in errors["too-long"]["body"]["error"]["message"]
    assert all(set(e["body"]["error"]) == {"message", "type", "param", "code"} for e in errors.values())


def test_bodies_validate_as_the_official_types_and_match_llm_generate(tiny_llm, batch_results):
    _, results = batch_results
    bodies = {r["custom_id"]: r["response"]["body"] for r in results if r["response"]["status_code"] == 200}
    text = Completion.model_validate(bodies["text"])
    expected = tiny_llm.generate("Hello world", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert text.choices[0].text == expected.outputs[0].text
    assert text.usage.prompt_tokens == len(expected.prompt_token_ids)
    ids = Completion.model_validate(bodies["ids"])
    assert len(ids.choices[0].logprobs.token_logprobs) == len(ids.choices[0].logprobs.tokens)
    chat = ChatCompletion.model_validate(bodies["chat"])
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens <= 6
    assert sum(len(c.logprobs.content) for c in chat.choices) == chat.usage.completion_tokens
    for choice in chat.choices:
        assert choice.message.role == "assistant"
        for entry in choice.logprobs.content:
            assert entry.token in [t.token for t in entry.top_logprobs] and len(entry.top_logprobs) <= 3


def test_bad_tools_and_constraints_are_refused_by_name_and_spare_the_rest(tiny_llm, tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    frob_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}
    lines = [_line("tool", "/v1/chat/completions", {**chat, "tools": [frob_tool]}),
             _line("regex", "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "a(b"}),
             _line("fine", "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "ab"})]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert run_batch(tiny_llm, source, target, "tiny") == (1, 2)
    results = {r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())}
    assert results["tool"]["body"]["error"]["param"] == "tools[0].function.parameters"
    assert results["regex"]["body"]["error"]["param"] == "guided_regex"
    assert results["fine"]["body"]["choices"][0]["text"] == "ab"


def test_a_priority_the_fcfs_engine_refuses_fails_its_line_only(tiny_llm, tmp_path):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    lines = [_line("urgent", "/v1/completions", {**body, "priority": -1}),
             _line("default", "/v1/completions", {**body, "priority": 0})]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    assert run_batch(tiny_llm, source, target, "tiny") == (1, 1)
    results = {r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())}
    assert results["urgent"]["status_code"] == 400 and results["urgent"]["body"]["error"]["param"] == "priority"
    assert results["default"]["status_code"] == 200


def _run(llm, tmp_path, lines, models="tiny"):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    counts = run_batch(llm, source, target, models)
    return counts, {r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())}


def test_lines_the_engine_refuses_fail_alone_with_the_servers_errors(tiny_llm, tmp_path):
    """Every per-request check, the engine's limits included, runs per line: before, one such line made run-batch
    exit 2 and write no results at all."""
    vocab, limit = tiny_llm.model.config.vocab_size, tiny_llm.config.max_logit_bias
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    refused = {
        "bias-id": ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        "stop-id": ({"stop_token_ids": [vocab + 5]}, "stop_token_ids"),
        "top-k": ({"top_k": vocab + 1, "temperature": 1}, "top_k"),
        "many-biases": ({"logit_bias": {str(t): 1 for t in range(limit + 1)}}, "logit_bias"),
        "many-stop-ids": ({"stop_token_ids": list(range(tiny_llm.config.max_stop_ids))}, "stop_token_ids"),
        "n": ({"n": tiny_llm.config.max_n + 1}, "n"),
        "logprobs": ({"logprobs": tiny_llm.config.max_logprobs + 1}, "logprobs"),
        "past-context": ({"prompt": list(range(5, 60)), "max_tokens": 10}, "max_tokens"),
    }
    lines = [_line(name, "/v1/completions", {**body, **extra}) for name, (extra, _) in refused.items()]
    lines += [_line("fine", "/v1/completions", body),
              _line("chat-logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 2, "logprobs": True, "top_logprobs": 21}),
              _line("chat-past-context", "/v1/chat/completions", {
                  "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 100})]
    counts, results = _run(tiny_llm, tmp_path, lines)
    assert counts == (1, len(lines) - 1)
    for name, (_, param) in refused.items():
        assert results[name]["status_code"] == 400 and results[name]["body"]["error"]["param"] == param, name
    assert results["chat-logprobs"]["body"]["error"]["param"] == "top_logprobs"
    assert results["chat-past-context"]["body"]["error"]["param"] == "max_completion_tokens"
    assert results["fine"]["status_code"] == 200


def test_past_the_context_is_refused_as_the_server_refuses_it_not_capped(tiny_llm, tmp_path):
    prompt = list(range(5, 60))  # 55 of the 64 tokens
    counts, results = _run(tiny_llm, tmp_path, [
        _line("capped-before", "/v1/completions", {"prompt": prompt, "max_tokens": 10}),
        _line("fits", "/v1/completions", {"prompt": prompt, "max_tokens": 9, "ignore_eos": True})])
    assert counts == (1, 1)
    assert "maximum context length is 64" in results["capped-before"]["body"]["error"]["message"]
    assert results["fits"]["body"]["usage"]["completion_tokens"] == 9


def test_a_lines_model_must_be_served(tiny_llm, tmp_path):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    counts, results = _run(tiny_llm, tmp_path, [
        _line("unknown", "/v1/completions", {**body, "model": "gpt-4"}),
        _line("second-name", "/v1/completions", {**body, "model": "alias"}),
        _line("no-model", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})],
        models=BatchModels(("tiny", "alias")))
    assert counts == (2, 1)
    error = results["unknown"]
    assert error["status_code"] == 404 and error["body"]["error"]["param"] == "model"
    assert error["body"]["error"]["type"] == "not_found_error" and "'tiny', 'alias'" in error["body"]["error"]["message"]
    assert results["second-name"]["body"]["model"] == results["no-model"]["body"]["model"] == "tiny"


def test_lora_modules_name_adapters_lines_run_with(tmp_path):
    """A line naming an adapter runs with it (its tokens are the offline API's with that adapter), one naming the
    base model runs without, in one batch."""
    from jaxserve.checkpoint.random_lora import write_random_lora_adapter
    from jaxserve.lora_request import LoRARequest
    from tests.test_lora_engine import builtin_config

    write_random_lora_adapter(tmp_path / "qv", builtin_config(), rank=4, projections=("q_proj", "v_proj"))
    llm = LLM(enable_lora=True, max_lora_rank=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              use_tqdm_on_load=False)
    adapter = LoRARequest("qv", 1, str(tmp_path / "qv"))
    llm.engine.add_lora(adapter)
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    counts, results = _run(llm, tmp_path, [_line("adapter", "/v1/completions", {**body, "model": "qv"}),
                                           _line("base", "/v1/completions", {**body, "model": "tiny"})],
                           models=BatchModels(("tiny",), {"qv": adapter}))
    assert counts == (2, 0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with_adapter, base = (llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False,
                                       lora_request=request)[0].outputs[0].text for request in (adapter, None))
    assert with_adapter != base
    assert results["adapter"]["body"]["choices"][0]["text"] == with_adapter
    assert results["adapter"]["body"]["model"] == "qv" and results["base"]["body"]["choices"][0]["text"] == base


def test_reasoning_effort_reaches_the_chat_template(tiny_llm, tmp_path):
    """As vLLM: a chat body's reasoning_effort is a variable of the chat template (reasoning models' templates read
    it); here a template that writes it makes the prompt longer by exactly its rendering."""
    from tests.tokenizer_fixtures import copy_builtin_tokenizer

    folder = copy_builtin_tokenizer(tmp_path / "tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{- bos_token }}{%- if reasoning_effort %}{{- 'effort: ' + reasoning_effort }}"
                               "{%- endif %}{%- for m in messages %}{{- m.role + ': ' + m.content }}{%- endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(tokenizer=str(folder), dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              use_tqdm_on_load=False)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    _, results = _run(llm, tmp_path, [_line("plain", "/v1/chat/completions", chat),
                                      _line("effort", "/v1/chat/completions", {**chat, "reasoning_effort": "high"})])
    expected = len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat["messages"], reasoning_effort="high"),
                                        add_special_tokens=False))
    assert results["effort"]["body"]["usage"]["prompt_tokens"] == expected
    assert expected > results["plain"]["body"]["usage"]["prompt_tokens"]
