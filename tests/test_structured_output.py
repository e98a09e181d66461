"""Structured output: every finished output of the built-in random model matches its constraint (jsonschema is the
oracle for JSON Schema), the on-device mask agrees with llguidance's own numpy mask, rows without a constraint are
untouched beside constrained ones, nothing compiles after warm-up, and bad constraints are refused by name."""

import asyncio
import dataclasses
import json
import re
import sys
import threading
from unittest import mock
from pathlib import Path

import jax
import jsonschema
import llguidance.numpy
import numpy as np
import pytest

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.errors import ConstraintFailedError, InvalidRequestError
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.runner.sampler import _apply_token_mask

PROMPT = "Hello"
MAX_TOKENS = 48  # every constraint below ends well within this, so a finished output is a whole one
# Bounded strings, numbers and arrays: the random model would otherwise fill max_tokens inside one.
SCHEMAS = {
    "nested object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "ok": {"type": "boolean"}},
                 "required": ["id", "ok"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array with min and max items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
             "additionalProperties": False},
    "bounded integer": {"type": "integer", "minimum": -5, "maximum": 250},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "anyOf": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
    "$ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"], "additionalProperties": False},
}


def _constrained(constraint: StructuredOutputsParams, temperature: float, seed: int = 0, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured_outputs=constraint,
                          **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_output_matches_its_json_schema(tiny_llm, temperature):
    names = list(SCHEMAS)
    outputs = tiny_llm.generate([PROMPT] * len(names), [_constrained(StructuredOutputsParams(json=SCHEMAS[name]),
                                                                     temperature, seed=i) for i, name in
                                                        enumerate(names)], use_tqdm=False)
    for name, output in zip(names, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


def test_regex_choice_grammar_and_json_object(tiny_llm):
    constraints = {
        "regex": StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}"),
        "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        "grammar": StructuredOutputsParams(grammar='start: "id=" NUM ("," NUM)?\nNUM: /[0-9]{1,3}/'),
        "json_object": StructuredOutputsParams(json_object=True),
    }
    params = [_constrained(c, temperature=1.0, seed=7, n=2) for c in constraints.values()]
    outputs = dict(zip(constraints, tiny_llm.generate([PROMPT] * len(params), params, use_tqdm=False)))
    for kind, output in outputs.items():
        assert [c.finish_reason for c in output.outputs] == ["stop", "stop"], kind
    assert all(re.fullmatch(r"[a-c]{3}-\d{2}", c.text) for c in outputs["regex"].outputs)
    assert all(c.text in ("yes", "no", "maybe") for c in outputs["choice"].outputs)
    assert all(re.fullmatch(r"id=\d{1,3}(,\d{1,3})?", c.text) for c in outputs["grammar"].outputs)
    assert all(isinstance(json.loads(c.text), dict) for c in outputs["json_object"].outputs)
    assert tiny_llm.engine.compiles_after_warmup == 0


def test_rows_without_a_constraint_are_untouched_beside_constrained_ones(tiny_llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = tiny_llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    beside = tiny_llm.generate([PROMPT, PROMPT], [plain, _constrained(StructuredOutputsParams(choice=["a", "b"]), 0)],
                               use_tqdm=False)
    assert beside[0].outputs[0].token_ids == alone and beside[1].outputs[0].text in ("a", "b")


def test_the_device_mask_agrees_with_llguidances_numpy_mask():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32: the last word is partly padding
    logits = rng.normal(size=(3, vocab)).astype(np.float32)  # f32[S, V]
    masks = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)  # i32[S, ceil(V / 32)]
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, masks)
    np.testing.assert_array_equal(np.asarray(jax.jit(_apply_token_mask)(logits, masks)), expected)


def _allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:  # mask: i32[W]
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


# Grammars of every kind, several rows each, scattered over a step's rows with unconstrained rows between them.
DIFFERENTIAL_CONSTRAINTS = [*(StructuredOutputsParams(json=schema) for schema in SCHEMAS.values()),
                            StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}(-[xyz]+)?"),
                            StructuredOutputsParams(choice=["Paris", "Lyon", "Marseille"]),
                            StructuredOutputsParams(grammar='start: "id=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'),
                            StructuredOutputsParams(json_object=True)]


def test_parallel_mask_filling_equals_the_sequential_reference_over_many_steps():
    """Twin sequences, one set on the sequential path (one thread, row by row) and one on llguidance's pool (a lexer
    per thread), each from a compiler of its own (no cache shared), follow the same random allowed tokens; every step
    both fill the same whole array, which also equals each matcher's own next_mask, and the rows without a grammar
    allow all."""
    from jaxserve.checkpoint import BUILTIN_MODEL_DIR
    from jaxserve.engine.structured_output import GrammarCompiler, MaskFiller
    from jaxserve.runner.token_masks import ALL_ALLOWED
    from jaxserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR)
    vocab = tokenizer.vocab_size
    compilers = {"sequential": GrammarCompiler(tokenizer, vocab, 30.0, mask_threads=1),
                 "parallel": GrammarCompiler(tokenizer, vocab, 30.0, mask_threads=3)}
    # Every step on the pool, however small (this vocabulary alone would keep every step on the calling thread).
    assert compilers["parallel"].masks.parallel_from_tokens > 30 * vocab
    compilers["parallel"].masks = MaskFiller(vocab, threads=3, parallel_from_tokens=0)
    constraints = {2 * index + 1: constraint for index, constraint in  # row -> its constraint, twice each
                   enumerate(DIFFERENTIAL_CONSTRAINTS * 2)}
    num_rows = 2 * len(constraints) + 2
    twins = {path: {row: compiler.matcher(c) for row, c in constraints.items()} for path, compiler in compilers.items()}
    # Each constraint's two sequences copy different start matchers on the parallel path (lexers not shared), the
    # same one on the sequential path.
    first_pair = (1, 2 * len(DIFFERENTIAL_CONSTRAINTS) + 1)  # the rows of the first constraint
    assert [len({twins[path][row].lexer for row in first_pair}) for path in compilers] == [1, 2]
    assert {compilers[path].check(c).num_lexers for path in compilers for c in DIFFERENTIAL_CONSTRAINTS} == {1, 3}
    rng = np.random.default_rng(0)
    restarts = 0
    for _ in range(60):
        filled = {path: compilers[path].masks.filled(twins[path], num_rows) for path in compilers}
        np.testing.assert_array_equal(filled["parallel"].allowed, filled["sequential"].allowed)
        allowed = filled["sequential"].allowed
        assert allowed.shape == (num_rows, compilers["sequential"].masks.width)
        assert sorted(filled["parallel"]) == sorted(constraints)
        free_rows = [row for row in range(num_rows) if row not in constraints]
        assert (allowed[free_rows] == ALL_ALLOWED).all()
        for row in constraints:
            np.testing.assert_array_equal(allowed[row], twins["sequential"][row].next_mask())
            token = int(rng.choice(_allowed_ids(allowed[row], vocab)))
            for path in compilers:
                twins[path][row].accept(token)
            if twins["sequential"][row].done:
                assert twins["parallel"][row].done
                restarts += 1
                for path, compiler in compilers.items():
                    twins[path][row] = compiler.matcher(constraints[row])
    assert restarts >= len(constraints)  # the grammars ran through to their ends, many states each


def test_only_steps_with_enough_to_fill_go_to_the_pool(tiny_llm, monkeypatch):
    """Handing a step to the pool costs its threads' wake-up: a few rows of a small vocabulary stay on the calling
    thread, and a step covering parallel_from_tokens goes to the pool."""
    from jaxserve.engine.structured_output import MaskFiller

    pooled, fill_par = [], llguidance.numpy.fill_next_token_bitmask_par  # rows of each step given to the pool

    def recorded_fill_par(executor, matchers, masks):
        pooled.append(len(matchers))
        fill_par(executor, matchers, masks)

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", recorded_fill_par)
    vocab = tiny_llm.model.config.vocab_size
    grammars = {row: tiny_llm.engine.grammars.matcher(StructuredOutputsParams(regex="ab+")) for row in (0, 2, 3)}
    small = MaskFiller(vocab, threads=2).filled(grammars, 4)
    assert pooled == []
    pool = MaskFiller(vocab, threads=2, parallel_from_tokens=3 * vocab).filled(grammars, 4)
    assert pooled == [3]
    np.testing.assert_array_equal(small.allowed, pool.allowed)


def test_masks_filled_in_place_go_to_the_devices_as_they_are():
    from jaxserve.runner.token_masks import ALL_ALLOWED, FilledMasks, StepMasks, all_allowed

    step_masks = StepMasks(vocab_size=70, to_devices=jax.device_put)  # 3 words a row
    filled = all_allowed(4, 3)
    filled[2] = [1, 2, 3]
    in_place = FilledMasks(filled, frozenset({2}))
    assert step_masks.host(4, in_place) is filled  # no copy
    assert dict(in_place.items()).keys() == {2} and list(in_place[2]) == [1, 2, 3]
    copied = step_masks.host(4, {2: np.array([1, 2, 3], np.int32)})  # a plain mapping is laid into all-ones rows
    np.testing.assert_array_equal(copied, filled)
    assert step_masks.host(4, {}) is None
    np.testing.assert_array_equal(np.asarray(step_masks.device(4, None)), np.full((4, 3), ALL_ALLOWED))


def test_the_engine_hands_its_step_the_masks_filled_in_place(tiny_llm, monkeypatch):
    """The engine's masks reach the runner as the step's own i32[S, W] array (S: the bucket's rows), so the runner
    sends it as it is; rows without a grammar allow every token."""
    from jaxserve.runner.token_masks import ALL_ALLOWED, FilledMasks

    runner = tiny_llm.engine.runner
    finish, handed = runner.finish, []

    def recorded_finish(started, masks):
        handed.append((started.bucket.num_seqs, masks, runner._masks.host(started.bucket.num_seqs, masks)))
        return finish(started, masks)

    monkeypatch.setattr(runner, "finish", recorded_finish)
    params = [_constrained(StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}"), 1.0),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    tiny_llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    constrained = [(rows, masks, host) for rows, masks, host in handed if masks]
    assert constrained and all(isinstance(masks, FilledMasks) and host is masks.allowed
                               and host.shape == (rows, runner._masks.width) for rows, masks, host in constrained)
    for _, masks, host in constrained:
        assert (np.delete(host, sorted(masks), axis=0) == ALL_ALLOWED).all()


@pytest.mark.parametrize("constraint, fault", [
    (StructuredOutputsParams(regex="a(b"), "unclosed group"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (StructuredOutputsParams(grammar="start: foo"), "unknown name"),
], ids=["regex", "json schema", "grammar"])
def test_an_invalid_constraint_is_refused_and_changes_nothing(tiny_llm, constraint, fault):
    with pytest.raises(InvalidRequestError, match=fault) as refused:
        tiny_llm.generate([PROMPT], _constrained(constraint, 0), use_tqdm=False)
    assert refused.value.param == "structured_outputs"
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("keywords", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": "{"}],
                         ids=["none", "two", "empty choice", "schema not JSON"])
def test_structured_outputs_params_take_exactly_one_valid_constraint(keywords):
    with pytest.raises(InvalidRequestError) as refused:
        StructuredOutputsParams(**keywords)
    assert refused.value.param == "structured_outputs"


def test_the_mask_benchmark_runs_on_a_synthetic_vocabulary():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import structured_output

    result = structured_output.measure_masks(structured_output.parse_args(["--seqs", "3", "--vocab", "3000",
                                                                            "--steps", "4"]))
    assert result["seqs"] == 3 and result["mask_ms_per_step_median"] > 0


def test_the_grammars_end_wins_over_min_tokens(tiny_llm):
    """min_tokens holds EOS back while the grammar may go on, and never past the grammar's end."""
    for regex, text in (("ab", "ab"), ("ab(c)?", "abc")):
        params = _constrained(StructuredOutputsParams(regex=regex), 1.0, min_tokens=8)
        [completion] = tiny_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
        assert (completion.text, completion.finish_reason) == (text, "stop")


NO_FINITE_OUTPUT = 'start: "a" start'  # every string of it goes on forever: the grammar engine fails after "a"


def test_a_grammar_that_cannot_go_on_fails_its_request_instead_of_stopping_it(tiny_llm):
    """The grammar engine's error state is not an end: before, this came back as the text "a", finish_reason stop.
    The request fails with an error naming its constraint; the engine, and requests beside it, go on."""
    params = _constrained(StructuredOutputsParams(grammar=NO_FINITE_OUTPUT), 0.0)
    with pytest.raises(ConstraintFailedError, match="cannot go on after 1 generated tokens") as failed:
        tiny_llm.generate([PROMPT], params, use_tqdm=False)
    assert failed.value.param == "structured_outputs"
    assert tiny_llm.engine.stats().num_running == tiny_llm.engine.stats().num_pages_used == 0
    prompts = [tiny_llm.tokenizer.encode(PROMPT)] * 3
    fine = _constrained(StructuredOutputsParams(regex="ab"), 0.0)
    results = tiny_llm.run_each([TokenizedPrompt(None, tuple(p)) for p in prompts], [fine, params, fine],
                                [None] * 3, use_tqdm=False)
    assert isinstance(results[1], ConstraintFailedError)
    assert [r.outputs[0].text for r in (results[0], results[2])] == ["ab", "ab"]


def test_a_grammar_compiled_too_slowly_is_refused_and_the_next_request_is_not_held(tiny_llm):
    from jaxserve.engine.structured_output import GrammarCompiler

    release = threading.Event()
    compiler = GrammarCompiler(tiny_llm.tokenizer, tiny_llm.model.config.vocab_size, compile_timeout_s=0.5)
    slow = StructuredOutputsParams(regex="slow")
    with mock.patch("jaxserve.engine.structured_output._grammar_text",
                    side_effect=lambda constraint: release.wait() and 'start: "slow"'):
        with pytest.raises(InvalidRequestError, match="did not compile within 0.5 s") as refused:
            compiler.check(slow)
    assert refused.value.param == "structured_outputs"
    compiler.check(StructuredOutputsParams(regex="fast"))  # the other compile thread is free
    release.set()


def test_the_server_waits_for_grammars_on_its_event_loop_not_on_its_threads(tiny_llm, monkeypatch):
    """Slow grammars, more of them than request threads and compile threads, hold no thread a plain request needs:
    /tokenize answers while all of them still compile; each then fails by itself, naming its field, and one past
    the time limit is refused as too slow."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.context import WORKER_THREADS, ServerContext
    from jaxserve.server.config import ServerConfig

    grammars = tiny_llm.engine.grammars
    release, never = threading.Event(), threading.Event()
    monkeypatch.setattr(grammars, "compile_timeout_s", 30.0)

    def slow_grammar(constraint):
        (never if "never" in constraint.regex else release).wait()
        raise InvalidRequestError("not a grammar after all", param="structured_outputs")

    context = ServerContext(engine=AsyncEngine(tiny_llm.engine), tokenizer=tiny_llm.tokenizer, config=ServerConfig(),
                            max_model_len=tiny_llm.max_model_len, vocab_size=tiny_llm.model.config.vocab_size)
    client = create_app(context).test_client()
    tag = f"{id(client)}"  # regexes of their own: the engine's compile cache outlives this test

    def constrained(index):
        return client.post("/v1/chat/completions", json={
            "model": "jaxserve-builtin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "guided_regex": f"slow-{tag}-{index}"})

    async def run():
        slow = [asyncio.ensure_future(constrained(index)) for index in range(WORKER_THREADS + 2)]
        tokenized = await client.post("/tokenize", json={"model": "jaxserve-builtin", "prompt": "Hello"})
        pending = sum(not request.done() for request in slow)
        release.set()
        answers = [await (await request).get_json() for request in slow]
        monkeypatch.setattr(grammars, "compile_timeout_s", 0.2)
        too_slow = await (await constrained(f"never-{tag}")).get_json()
        never.set()
        with pytest.raises(InvalidRequestError, match="not a grammar"):  # its compile thread is free again
            await grammars.compiled(StructuredOutputsParams(regex=f"slow-{tag}-never-{tag}"))
        return tokenized.status_code, pending, answers, too_slow

    with mock.patch("jaxserve.engine.structured_output._grammar_text", side_effect=slow_grammar):
        tokenized, pending, answers, too_slow = asyncio.run(run())
    assert tokenized == 200 and pending == WORKER_THREADS + 2
    assert all(answer["error"]["param"] == "guided_regex" and "not a grammar" in answer["error"]["message"]
               for answer in answers)
    assert too_slow["error"]["param"] == "guided_regex"
    assert "did not compile within 0.2 s" in too_slow["error"]["message"]


def test_a_sequence_starts_from_a_copy_of_the_compiled_matcher(tiny_llm):
    constraint = StructuredOutputsParams(choice=["Paris", "Lyon"])
    first, second = (tiny_llm.engine.grammars.matcher(constraint) for _ in range(2))
    first.accept(tiny_llm.tokenizer.encode("P", add_special_tokens=False)[0])
    assert not np.array_equal(first.next_mask(), second.next_mask())


def _step_events(monkeypatch, engine) -> list[tuple]:
    """Records, in order, each step's start (does it draw under a grammar), each read-back, and each finish (was
    its forward pass already running, did it bring masks)."""
    from jaxserve.runner.step_results import PendingStep

    events = []
    start, finish, fetch = engine.runner.start, engine.runner.finish, PendingStep.fetch

    def logged_start(schedule):
        events.append(("start",))
        return start(schedule)

    def logged_finish(started, masks):
        events.append(("finish", started.forward_running, bool(masks)))
        return finish(started, masks)

    def logged_fetch(self):
        events.append(("fetch",))
        return fetch(self)

    monkeypatch.setattr(engine.runner, "start", logged_start)
    monkeypatch.setattr(engine.runner, "finish", logged_finish)
    monkeypatch.setattr(PendingStep, "fetch", logged_fetch)
    return events


def _masks_filled_while_the_forward_pass_ran(events: list[tuple]) -> int:
    """Steps whose masks followed a read-back that came after their forward pass was dispatched."""
    return sum(events[i:i + 3] == [("start",), ("fetch",), ("finish", True, True)] for i in range(len(events) - 2))


def test_masks_are_filled_while_the_forward_pass_runs_and_change_no_token(tiny_llm, monkeypatch):
    """Async overlap with grammars (each mask filled after the previous step's read-back, during the next step's
    forward pass) gives exactly the tokens of the engine without overlap, which reads every step back first."""
    constraints = [StructuredOutputsParams(json=SCHEMAS["$ref"]), StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}"),
                   None]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=c)
              for i, c in enumerate(constraints)] + [SamplingParams(max_tokens=12, temperature=0)]
    engine = tiny_llm.engine
    runs = {}
    for overlap in (True, False):
        monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, async_scheduling=overlap))
        events = _step_events(monkeypatch, engine)
        outputs = tiny_llm.generate([PROMPT, "abc", "x y", PROMPT], params, use_tqdm=False)
        runs[overlap] = [(c.token_ids, c.finish_reason) for output in outputs for c in output.outputs]
        overlapped = _masks_filled_while_the_forward_pass_ran(events)
        assert overlapped > 10 if overlap else overlapped == 0
    assert runs[True] == runs[False]
    jsonschema.validate(json.loads(tiny_llm.tokenizer.decode(runs[True][0][0])), SCHEMAS["$ref"])
    assert engine.compiles_after_warmup == 0
