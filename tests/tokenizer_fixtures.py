"""Tokenizer test helpers: tricky strings, a tiny SentencePiece model trained on the spot, model-folder builders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from jaxserve.tokenizer.token_bytes import byte_level_alphabet

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "jaxserve" / "builtin"
BUILTIN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Strings tokenizers get wrong in different ways: leading, doubled and trailing spaces (sentencepiece's dummy prefix),
# newlines and tabs, digit runs (split differently by each pre-tokenizer), multi-byte characters (emoji with
# modifiers, CJK), and characters that appear in no training text (byte fallback).
TRICKY_TEXTS = (
    "",
    " ",
    "Hello world",
    " Hello world",
    "  two  spaces  between  ",
    "trailing space ",
    "line one\nline two\n\n\nafter blank lines",
    "\ttab\tseparated\t",
    "digits 1234567890 and 3.14159, 42%",
    "emoji 😀 thumbs 👍🏽 family 👨‍👩‍👧",
    "日本語の文章と中文句子",
    "café naïve Ünïcödé",
    "rare ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ ⅋",
    "<s> and </s> written as text",
    "mixed: def f(x):\n    return x ** 2  # square\n",
)

SENTENCEPIECE_CORPUS = (
    "Hello world, hello there! The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step, and then another one.",
    "The model reads the prompt and writes an answer, one token after another.",
    "Numbers like 12345 and 3.14 are split into digits by this tokenizer.",
    "Two  spaces  and   three   spaces keep their width when decoded.",
    "def square(x):\n    return x * x\n",
    "Good morning everyone, today we talk about the history of printing and the world of books.",
    "She said that she would come back later, but nobody knew when she would be here.",
)


def train_sentencepiece(model_file: Path, vocab_size: int = 420, **options: Any) -> None:
    """Train a Llama-2-like BPE SentencePiece model (byte fallback, digits split, whitespace kept) into `model_file`.

    `remove_extra_whitespaces=False` matters: the default collapses runs of spaces, so text would not round-trip.
    `options` go to the trainer as extra settings.
    """
    import sentencepiece

    prefix = model_file.with_suffix("")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCEPIECE_CORPUS * 20),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    prefix.with_suffix(".model").rename(model_file)
    prefix.with_suffix(".vocab").unlink()


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2), encoding="utf-8")
    return path


def copy_builtin_tokenizer(folder: Path) -> Path:
    """A model folder holding the built-in tokenizer files, for tests that edit them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in BUILTIN_TOKENIZER_FILES:
        shutil.copy(BUILTIN_DIR / name, folder / name)
    return folder


def gpt2_byte_to_char() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), to find single-byte token ids."""
    return {byte: char for char, byte in byte_level_alphabet().items()}


def make_llama2_folder(folder: Path) -> Path:
    """A Llama-2-style model folder: tokenizer.model plus a tokenizer_config.json naming <s> and </s>."""
    folder.mkdir(parents=True, exist_ok=True)
    train_sentencepiece(folder / "tokenizer.model")
    write_json(folder / "tokenizer_config.json",
               {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "legacy": False})
    return folder


# Shaped like Llama 3.1 Instruct's template: system header with dates, tools (in the first user message by default),
# single tool calls, tool results and ipython turns.
LLAMA31_STYLE_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
