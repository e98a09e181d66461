"""Structured output under the engine's stresses: preemption by recompute, prefix caching, chunked prefill and stop
strings. The oracle is an unstressed engine (a pool with room for every sequence, no prefix cache, no chunking):
greedy constrained outputs under each stress must be exactly its outputs, each stress must be seen to happen, and
every finished output must match its constraint (jsonschema for JSON Schema, re.fullmatch for the others).

Stop strings follow vLLM: the text ends before the first stop string (with it, under include_stop_str_in_output),
finish_reason is "stop" and stop_reason the string, and the token that completed it is the last generated."""

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.engine.request import Request
from jaxserve.tokenizer.loader import load_tokenizer
from tests.test_engine import ENGINE, TINY_POOL
from tests.test_structured_output import SCHEMAS

MAX_TOKENS = 48  # every constraint below ends well within this (the longest, "$ref", takes 37 tokens)
REGEX = r"[a-c]{3}-[0-9]{2}"
GRAMMAR, GRAMMAR_LANGUAGE = 'start: "id=" NUM ("," NUM)?\nNUM: /[0-9]{1,3}/', r"id=[0-9]{1,3}(,[0-9]{1,3})?"
CHOICES = ("yes", "no", "maybe")
JSON_CASES = ("$ref", "nested object", "array with min and max items", "enum", "string pattern", "bounded integer")
CONSTRAINTS = {
    **{f"json {name}": StructuredOutputsParams(json=SCHEMAS[name]) for name in JSON_CASES},
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=list(CHOICES)),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
BUILTIN_TOKENIZER = load_tokenizer(BUILTIN_MODEL_DIR)
ASCII_TOKENS = [i for i in range(3, 500) if BUILTIN_TOKENIZER.token_bytes(i).isascii()]
SHORT = [name for name in CONSTRAINTS if name not in ("json $ref", "json nested object")]  # at most 16 tokens


def _assert_matches(constraint: StructuredOutputsParams, text: str) -> None:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.schema)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict), text
    elif constraint.choice is not None:
        assert text in constraint.choice, text
    else:
        assert re.fullmatch(REGEX if constraint.regex is not None else GRAMMAR_LANGUAGE, text), (constraint, text)


def _assert_all_match(outputs, params) -> None:
    """Every continuation finished by its grammar (not by length) and matches its constraint."""
    for output, p in zip(outputs, params):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (p.structured_outputs, completion)
            _assert_matches(p.structured_outputs, completion.text)


def _workload(lengths, names, seed, shared=0, sampled=False):
    """Token-id prompts of the given lengths (the first `shared` tokens common to all), each under the next
    constraint of `names`; greedy, or (`sampled`) drawn with a seed of its own, every other prompt with n=2.

    The prompts' tokens are whole ASCII text: a prompt ending inside a UTF-8 character is the business of
    test_a_prompt_ending_inside_a_character_adds_no_replacement_character."""
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.choice(ASCII_TOKENS, size=shared)]
    prompts = [{"prompt_token_ids": prefix + [int(t) for t in rng.choice(ASCII_TOKENS, size=n - shared)]}
               for n in lengths]
    drawn = [dict(temperature=1.0, seed=100 + i, n=1 + i % 2) if sampled else dict(temperature=0)
             for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[names[i % len(names)]], **drawn[i])
              for i in range(len(lengths))]
    return prompts, params


def _completions(outputs):
    return [output.outputs for output in outputs]


@pytest.fixture(scope="module")
def oracle():
    """Unstressed: 39 pages of 8 tokens hold four sequences of 64, no prefix cache, no prompt split over steps."""
    return LLM(**ENGINE, enable_prefix_caching=False, enable_chunked_prefill=False)


def _oracle_outputs(oracle, prompts, params):
    outputs = oracle.generate(prompts, params, use_tqdm=False)
    stats = oracle.engine.stats()
    assert stats.num_preemptions == 0 and stats.prefix_hit_tokens == 0  # it really is unstressed
    return outputs


@pytest.fixture(scope="module")
def tiny_pool_llm():
    """88 token slots for four sequences of up to 64 tokens: preempts."""
    return LLM(**TINY_POOL)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded sampling, n=2"])
def test_preempted_constrained_requests_recompute_to_the_oracles_outputs(oracle, tiny_pool_llm, monkeypatch, sampled):
    """Four sequences of up to 26 + 37 tokens in 88 token slots: requests lose their pages mid-output, keep their
    grammar's state and recompute prompt and outputs. Seeded draws reproduce too (each draw's key is the request's
    seed and the draw's place in the output, whatever the batch)."""
    lost = []  # (under a grammar, outputs generated when it lost its pages)
    reset = Request.reset_for_recompute

    def recorded_reset(request):
        lost.append((request.grammar is not None, request.num_output_tokens))
        reset(request)

    monkeypatch.setattr(Request, "reset_for_recompute", recorded_reset)
    engine = tiny_pool_llm.engine
    before = engine.stats().num_preemptions
    prompts, params = _workload([26, 9, 20, 14, 25, 11, 17, 23], list(CONSTRAINTS), seed=0, sampled=sampled)
    outputs = tiny_pool_llm.generate(prompts, params, use_tqdm=False)
    stats = engine.stats()
    assert stats.num_preemptions > before and any(constrained and made > 0 for constrained, made in lost), lost
    assert _completions(outputs) == _completions(_oracle_outputs(oracle, prompts, params))
    _assert_all_match(outputs, params)
    assert stats.num_pages_used == 0 and engine.compiles_after_warmup == 0


def test_prefix_cache_hits_change_no_constrained_output(oracle):
    """Prefix caching on against off: prompts sharing 16 tokens (two pages), one of exactly three pages asked twice
    (every page a hit), and the same prompts again under other constraints (pages written by constrained requests)."""
    llm = LLM(**ENGINE)  # prefix caching on; the oracle's shapes, so its programs come from the compile cache
    prompts, params = _workload([24, 17, 21, 24, 19, 26], list(CONSTRAINTS), seed=1, shared=16)
    prompts[3] = prompts[0]
    rotated = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=p.structured_outputs)
               for p in params[1:] + params[:1]]
    before = llm.engine.stats().prefix_hit_tokens
    for batch in (params, rotated):
        outputs = llm.generate(prompts, batch, use_tqdm=False)
        assert _completions(outputs) == _completions(_oracle_outputs(oracle, prompts, batch))
        _assert_all_match(outputs, batch)
    # Requests admitted in one step each compute their prompt; the second batch finds all the full pages cached.
    page = ENGINE["block_size"]
    assert llm.engine.stats().prefix_hit_tokens - before >= sum(page * (len(p["prompt_token_ids"]) // page)
                                                                for p in prompts)
    assert llm.engine.compiles_after_warmup == 0


def test_prompts_split_over_steps_change_no_constrained_output(oracle, tiny_llm, monkeypatch):
    """tiny_llm computes at most 32 tokens a step: prompts of 33 to 44 tokens are split, their chunks batched with
    other requests' constrained draws."""
    limit = tiny_llm.engine.config.max_num_batched_tokens
    chunks = {}  # request id -> (prompt length, prompt chunks scheduled)
    schedule = tiny_llm.engine.scheduler.schedule

    def recorded_schedule():
        output = schedule()
        for s in output.sequences:
            prompt_len = len(s.sampling.prompt_ids)
            if s.start_position < prompt_len:
                chunks[s.request_id] = (prompt_len, chunks.get(s.request_id, (0, 0))[1] + 1)
        return output

    monkeypatch.setattr(tiny_llm.engine.scheduler, "schedule", recorded_schedule)
    prompts, params = _workload([33, 44, 40, 36, 42, 38], SHORT, seed=2)
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert limit < 33 and len(chunks) == len(prompts) and all(n >= 2 for _, n in chunks.values()), chunks
    assert _completions(outputs) == _completions(_oracle_outputs(oracle, prompts, params))
    _assert_all_match(outputs, params)
    assert tiny_llm.engine.compiles_after_warmup == 0


def _first_tokens_holding(oracle, token_ids, stop) -> tuple[int, ...]:
    """The shortest start of `token_ids` whose text contains `stop`: where a stop string ends generation."""
    for k in range(1, len(token_ids) + 1):
        if stop in oracle.tokenizer.decode(list(token_ids[:k])):
            return tuple(token_ids[:k])
    raise AssertionError(f"{stop!r} is not in the text of {token_ids}")


# (id, constraint name, the stop string from the unstressed output's text, include_stop_str_in_output)
STOP_CASES = [
    ("regex cut at its dash", "regex", lambda text: "-", False),
    ("JSON cut before a key", "json $ref", lambda text: ',"b"', False),
    ("JSON cut before a key, stop kept", "json $ref", lambda text: ',"b"', True),
    ("ends with the grammar's last token", "json $ref", lambda text: "}}", False),
    ("ends with the grammar's last token, stop kept", "json nested object", lambda text: "}}", True),
    ("the whole output", "choice", lambda text: text, False),
    ("begun by the output's end, never completed", "json $ref", lambda text: "}@", False),
    ("begun by the output's end, never completed (regex)", "regex", lambda text: text[-1] + "~", False),
]


@pytest.mark.parametrize("name, stop_of, include", [case[1:] for case in STOP_CASES],
                         ids=[case[0] for case in STOP_CASES])
def test_a_stop_string_inside_a_constrained_output_ends_it_as_vllm_does(oracle, name, stop_of, include):
    prompts, params = _workload([5, 12], [name], seed=3)
    for prompt, p, [unstopped] in zip(prompts, params, _completions(_oracle_outputs(oracle, prompts, params))):
        assert unstopped.finish_reason == "stop"
        stop = stop_of(unstopped.text)
        stopped = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs=p.structured_outputs,
                                 stop=[stop], include_stop_str_in_output=include)
        [completion] = oracle.generate(prompt, stopped, use_tqdm=False)[0].outputs
        at = unstopped.text.find(stop)
        if at < 0:  # the output's end was held back as the stop string's beginning, then released
            assert unstopped.text.endswith(stop[0]) and completion == unstopped
            continue
        assert (completion.text, completion.finish_reason, completion.stop_reason) == (
            unstopped.text[:at + (len(stop) if include else 0)], "stop", stop)
        assert completion.token_ids == _first_tokens_holding(oracle, unstopped.token_ids, stop)
        if include and at + len(stop) == len(unstopped.text):
            _assert_matches(p.structured_outputs, completion.text)


def test_a_prompt_ending_inside_a_character_adds_no_replacement_character(oracle):
    """A token-id prompt may end with the first byte of a three-byte character that the output never completes: the
    output's text is what its tokens add to the prompt's text (vLLM's too), so the prompt's broken character stays
    the prompt's and the constrained text parses."""
    tokenizer = oracle.tokenizer
    lead_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == "日".encode()[:1])
    prompt = [*tokenizer.encode("a", add_special_tokens=False), lead_byte]
    constraint = CONSTRAINTS["json array with min and max items"]
    [completion] = oracle.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs=constraint), use_tqdm=False)[0].outputs
    added = tokenizer.decode([*prompt, *completion.token_ids])[len(tokenizer.decode(prompt)):]
    assert completion.text == added
    _assert_matches(constraint, completion.text)
