"""Reasoning and tool-call parsers on texts and token streams: `<think>...</think>` apart from the content (qwen3,
deepseek_r1), calls in Hermes' `<tool_call>` blocks and Mistral's `[TOOL_CALLS]` array beside Llama 3's JSON, the
same however the text streams (cut anywhere, or detokenized token by token as the engine releases it); the grammars
that force calls in each format, and output constraints after the reasoning, accept what they should and refuse what
they should (llguidance over the built-in tokenizer is the oracle); chat_template_kwargs reach the template.
"""

import json

import llguidance
import pytest

from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.engine.structured_output import _ll_tokenizer
from jaxserve.errors import InvalidRequestError
from jaxserve.openai.answer_reader import AnswerReader, read_answer
from jaxserve.openai.bodies import chat_template_variables, structured_outputs_from_body
from jaxserve.openai.reasoning import (DEEPSEEK_R1, QWEN3, ReasoningParser, after_reasoning, constraint_rules,
                                       reasoning_for_prompt)
from jaxserve.openai.requests import ChatCompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.tool_call_formats import HERMES, LLAMA3_JSON, MISTRAL, TOOL_CALL_FORMATS, match_pieces
from jaxserve.openai.tool_calls import delta_tool_calls, tool_calling_from_body
from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QWEN3_OPEN = reasoning_for_prompt(QWEN3, "<|im_start|>assistant\n")  # the answer may open <think>
QWEN3_CLOSED = reasoning_for_prompt(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
QWEN3_INSIDE = reasoning_for_prompt(QWEN3, "<|im_start|>assistant\n<think>\n")  # a thinking template opened it
R1 = reasoning_for_prompt(DEEPSEEK_R1, "<｜Assistant｜>")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUILTIN_MODEL_DIR)


def _calling(fmt, choice="auto", parallel=True, tools=(WEATHER, TIME)):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": list(tools), "tool_choice": choice,
            "parallel_tool_calls": parallel}
    return tool_calling_from_body(parse_body(ChatCompletionRequestBody, body).model_dump(exclude_none=True), fmt)


def streamed(text: str, pieces: list[str], reasoning, calling):
    """(reasoning, content, [(name, arguments)]) from the answer fed in `pieces`, and what the whole text gives."""
    reader = AnswerReader(reasoning, calling)
    said = [reader.feed(piece) for piece in pieces] + [reader.finish()]
    calls = delta_tool_calls([event for piece in said for event in piece.call_events])
    got = ("".join(s.reasoning for s in said), "".join(s.content for s in said),
           [(call["function"]["name"], call["function"]["arguments"]) for call in calls])
    whole, whole_calls = read_answer(text, reasoning, calling)
    assert got == (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole_calls]), pieces
    return got


def every_cut(text: str) -> list[list[str]]:
    return [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]


# ---- reasoning -----------------------------------------------------------------------------------------------------

REASONING_ANSWERS = [  # (reasoning, text, reasoning_content, content)
    (QWEN3_OPEN, "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    (QWEN3_OPEN, "  <think>a<b</think>c", "a<b", "c"),
    (QWEN3_OPEN, "It is 4.", "", "It is 4."),  # no <think>: all content
    (QWEN3_OPEN, "<thin", "", "<thin"),
    (QWEN3_OPEN, "<think>cut off before the end", "cut off before the end", ""),
    (QWEN3_OPEN, "2 < 3 </think> still content", "", "2 < 3 </think> still content"),
    (QWEN3_CLOSED, "It is 4. <think>no</think>", "", "It is 4. <think>no</think>"),
    (QWEN3_INSIDE, "Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),
    (R1, "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    (R1, "<think>Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    (R1, "thinking </thi", "thinking </thi", ""),  # cut off inside the end tag: reasoning
    (R1, "</think>", "", ""),
]


@pytest.mark.parametrize("reasoning, text, reasoning_content, content", REASONING_ANSWERS)
def test_reasoning_reads_the_same_however_it_streams(reasoning, text, reasoning_content, content):
    for pieces in every_cut(text):
        assert streamed(text, pieces, reasoning, None) == (reasoning_content, content, [])


def test_where_the_answer_starts_comes_from_the_prompt():
    assert not QWEN3_OPEN.starts_inside and not QWEN3_CLOSED.starts_inside and QWEN3_INSIDE.starts_inside
    assert R1.starts_inside  # DeepSeek-R1 always thinks first
    assert reasoning_for_prompt(QWEN3, None) == QWEN3_OPEN
    # An earlier turn's closed reasoning does not open the answer's.
    assert not reasoning_for_prompt(QWEN3, "<think>a</think>b<|im_start|>assistant\n").starts_inside


def test_reasoning_of_a_token_stream_as_the_engine_detokenizes_it(tokenizer):
    text = "<think>\nIs 12 > 9? Yes.\n</think>\n\nThe larger is 12."
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in tokenizer.encode(text, add_special_tokens=False)]
    assert "".join(pieces) == text and len(pieces) > 20
    assert streamed(text, pieces, QWEN3_OPEN, None) == ("\nIs 12 > 9? Yes.\n", "\n\nThe larger is 12.", [])


def test_a_reasoning_parser_holds_back_only_a_possible_tag():
    parser = ReasoningParser(R1)
    assert [p.text for p in parser.feed("abc</")] == ["abc"]
    assert [p.text for p in parser.feed("x")] == ["</x"]
    assert [(type(p).__name__, p.text) for p in parser.feed("</think>ok")] == [("AnswerText", "ok")]


# ---- tool-call formats ---------------------------------------------------------------------------------------------

HERMES_ANSWERS = [  # (text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", '{"city": "Paris"}')]),
    ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"<"}}\n</tool_call>\n'
     '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>', "Let me check.",
     [("get_weather", '{"city": "a}\\"<"}'), ("get_time", "{}")]),
    ("No call needed: 2 < 3.\n", "No call needed: 2 < 3.\n", []),
    ('<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"z": 1', "", [("get_time", '{"z": 1')]),
]
MISTRAL_ANSWERS = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ('Sure. [TOOL_CALLS][{"name":"get_time","arguments":{"a":[1,{"b":"]"}]}}]', "Sure.",
     [("get_time", '{"a":[1,{"b":"]"}]}')]),
    ("Plain [text] answer", "Plain [text] answer", []),
]
LLAMA_ANSWERS = [
    ('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("Hello there", "Hello there", []),
]


@pytest.mark.parametrize("fmt, text, content, calls",
                         [(HERMES, *answer) for answer in HERMES_ANSWERS] +
                         [(MISTRAL, *answer) for answer in MISTRAL_ANSWERS] +
                         [(LLAMA3_JSON, *answer) for answer in LLAMA_ANSWERS])
def test_each_format_reads_the_same_however_it_streams(fmt, text, content, calls):
    for pieces in every_cut(text):
        assert streamed(text, pieces, None, _calling(fmt)) == ("", content, calls)


def test_without_parallel_calls_only_the_first_is_read():
    text = HERMES_ANSWERS[1][0]
    assert len(read_answer(text, None, _calling(HERMES, parallel=False))[1]) == 1
    assert len(read_answer(MISTRAL_ANSWERS[0][0], None, _calling(MISTRAL, parallel=False))[1]) == 1


def test_reasoning_then_calls_of_qwen3(tokenizer):
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Rome"}}\n</tool_call>'
    expected = ("\nThe user wants weather.\n", "", [("get_weather", '{"city": "Rome"}')])
    for pieces in every_cut(text):
        assert streamed(text, pieces, QWEN3_OPEN, _calling(HERMES)) == expected
    detokenizer = IncrementalDetokenizer(tokenizer)
    tokens = [detokenizer.push(token) for token in tokenizer.encode(text, add_special_tokens=False)]
    assert streamed(text, tokens, QWEN3_OPEN, _calling(HERMES)) == expected


def test_heads_match_as_they_grow():
    head = HERMES.first_head
    assert match_pieces("<tool", head).status == "maybe"
    assert match_pieces('<tool_call> { "name" : "f', head).status == "maybe"
    assert match_pieces('<tool_call>\n{"name": "f", "arguments": {', head).name == "f"
    assert match_pieces('<tool_call>\n{"title"', head).status == "no"
    assert match_pieces('{"name": "' + "x" * 65, LLAMA3_JSON.first_head).status == "no"
    assert set(TOOL_CALL_FORMATS) == {"llama3_json", "hermes", "mistral"}


# ---- grammars ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accepts(tokenizer):
    """accepts(constraint, text): whether llguidance lets the built-in tokenizer's tokens of `text` through the
    constraint's grammar to an accepting end."""
    ll_tokenizer = _ll_tokenizer(tokenizer, tokenizer.vocab_size)

    def check(constraint: StructuredOutputsParams, text: str) -> bool:
        grammar = llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    return check


FORCED = {  # format -> (an answer its forced calls allow, one they do not)
    HERMES: ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>\n<tool_call>\n'
             '{"name":"get_time","arguments":{}}\n</tool_call>',
             '{"name":"get_weather","arguments":{"city":"Rome"}}'),
    MISTRAL: ('[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Rome"}}, {"name":"get_time","arguments":{}}]',
              '[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Rome is far away"}}]'),
    LLAMA3_JSON: ('{"name":"get_weather","parameters":{"city":"Rome"}}; {"name":"get_time","parameters":{}}',
                  '{"name":"get_weather","arguments":{"city":"Rome"}}'),
}


@pytest.mark.parametrize("fmt", FORCED, ids=lambda fmt: fmt.name)
def test_forced_calls_are_written_in_the_format_and_read_back(fmt, accepts):
    allowed, refused = FORCED[fmt]
    calling = _calling(fmt, "required")
    assert accepts(calling.constraint(), allowed) and not accepts(calling.constraint(), refused)
    assert [(c.name, json.loads(c.arguments)) for c in read_answer(allowed, None, calling)[1]] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]
    named = _calling(fmt, {"type": "function", "function": {"name": "get_time"}})
    assert not accepts(named.constraint(), allowed)  # one call, of get_time only


CONSTRAINTS = [  # (constraint, an answer after the reasoning it allows, one it does not)
    (StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
     '{"n":4}', '{"n":"four"}'),
    (StructuredOutputsParams(json_object=True), '{"a":[1]}', "[1]"),
    (StructuredOutputsParams(regex=r"[0-9]+/[0-9]+"), "3/4", "3 / 4"),
    (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
]


@pytest.mark.parametrize("constraint, allowed, refused", CONSTRAINTS, ids=lambda c: getattr(c, "kind", None))
def test_a_constraint_applies_after_free_reasoning(constraint, allowed, refused, accepts):
    thinking = "<think>\nAnything: {not json} 1/2 yes?\n</think>\n\n"
    after = after_reasoning(QWEN3_OPEN, constraint_rules(constraint))
    assert accepts(after, thinking + allowed) and accepts(after, allowed)  # qwen3 may skip its reasoning
    assert not accepts(after, thinking + refused) and not accepts(after, "Anything " + allowed)
    inside = after_reasoning(R1, constraint_rules(constraint))
    assert accepts(inside, "plan: {x}</think>" + allowed) and not accepts(inside, allowed)


def test_forced_calls_apply_after_the_reasoning_too(accepts):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, TIME], "tool_choice": "required"}
    fields = parse_body(ChatCompletionRequestBody, body).model_dump(exclude_none=True)
    calling = tool_calling_from_body(fields, HERMES)
    constraint, field = structured_outputs_from_body(fields, calling, QWEN3_OPEN)
    assert field == "tool_choice"
    assert accepts(constraint, "<think>\nweather, then time\n</think>\n\n" + FORCED[HERMES][0])
    assert not accepts(constraint, "<think>\nok\n</think>\n\nNo calls.")


def test_a_grammar_constraint_cannot_follow_reasoning():
    with pytest.raises(InvalidRequestError, match="cannot follow a reasoning model's reasoning") as refused:
        structured_outputs_from_body({"structured_outputs": {"grammar": 'start: "a"'}}, None, QWEN3_OPEN)
    assert refused.value.param == "structured_outputs"


# ---- chat_template_kwargs ------------------------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template_and_win_over_reasoning_effort():
    body = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "high"}}
    assert chat_template_variables(body, None) == {"tools": None, "reasoning_effort": "high", "enable_thinking": False}


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_chat_template_kwargs_cannot_set_what_the_body_has_fields_for(key):
    with pytest.raises(InvalidRequestError, match=f"cannot set {key}") as refused:
        chat_template_variables({"chat_template_kwargs": {key: []}}, None)
    assert refused.value.param == "chat_template_kwargs"
