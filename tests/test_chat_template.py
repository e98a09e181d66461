"""Chat templates: rendered byte-for-byte like transformers, sandboxed, with errors surfacing as TokenizerError."""

import re

import pytest

from jaxserve.errors import TokenizerError
from jaxserve.tokenizer import ChatTemplate, flatten_text_content, load_tokenizer
from tests.tokenizer_fixtures import BUILTIN_DIR, LLAMA31_STYLE_TEMPLATE, copy_builtin_tokenizer, write_json

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

# Exercises what real templates lean on: whitespace control, tojson with indent, namespace, loop controls,
# strftime_now and a date_string default, tools and documents, content given as a list of parts, a missing key
# (content: None is dropped), and transformers' {% generation %} tag.
FEATURE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
Today: {{ date_string }}
{%- if tools is not none %}
Tools:
{{ tools | tojson(indent=2) }}
{%- endif %}
{%- if documents %}
{% for doc in documents %}[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}
{%- endif %}
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
    {%- if message.role == 'stop' %}{% break %}{% endif %}
<{{ message.role }}>
    {%- if message.content is not defined %}(calls {{ message.tool_calls | map(attribute='name') | join(', ') }})
    {%- elif message.content is string %}{{ message.content }}
    {%- else %}{% for part in message.content %}{{ part.text }}{% if not loop.last %} | {% endif %}{% endfor %}
    {%- endif %}
    {%- if message.role == 'assistant' %}{% generation %} [{{ eos_token }}]{% endgeneration %}{% endif %}
{% endfor %}
users={{ ns.users }} {{ {"k": "é", "z": 1, "a": [1, 2]} | tojson }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}"""

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello there!"}],
    "system_user": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"}],
    "full_turns": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀 in 日本語.\nThanks"},
    ],
}


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer(BUILTIN_DIR)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(BUILTIN_DIR)


def with_template(folder, template):
    copy_builtin_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return load_tokenizer(folder)


@pytest.mark.parity
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=str)
def test_llama3_template_matches_transformers(builtin, reference, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert builtin.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_llama3_template_shape(builtin):
    rendered = builtin.apply_chat_template(CONVERSATIONS["system_user"])
    assert rendered == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert builtin.encode(rendered, add_special_tokens=False).count(builtin.bos_token_id) == 1


@pytest.mark.parity
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama2_template_matches_transformers(tmp_path, reference, add_generation_prompt):
    ours = with_template(tmp_path, LLAMA2_TEMPLATE)
    messages = CONVERSATIONS["full_turns"]
    expected = reference.apply_chat_template(messages, chat_template=LLAMA2_TEMPLATE, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parity
@pytest.mark.parametrize("extra", [
    {},
    {"date_string": "26 Jul 2024"},
    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str", "ü": 1}}}],
     "documents": [{"title": "Doc", "text": "Some text"}]},
], ids=["defaults", "date_string", "tools_documents"])
def test_feature_template_matches_transformers(tmp_path, reference, extra):
    ours = with_template(tmp_path, FEATURE_TEMPLATE)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather"}, {"name": "lookup"}]},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "done"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "after the break"},
    ]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **extra)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra) == expected


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": {"temperature": 21, "sky": "clear"}},
    {"role": "tool", "content": "plain text result"},
]


@pytest.mark.parity
@pytest.mark.parametrize("extra", [
    {},
    {"tools": [WEATHER_TOOL]},
    {"tools": [WEATHER_TOOL], "tools_in_user_message": False, "date_string": "01 Jan 2025"},
    {"builtin_tools": ["get_weather", "code_interpreter"]},
], ids=["no_tools", "tools_in_user_message", "tools_in_system", "builtin_tools"])
def test_llama31_style_template_matches_transformers(tmp_path, reference, extra):
    ours = with_template(tmp_path, LLAMA31_STYLE_TEMPLATE)
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(TOOL_CONVERSATION, chat_template=LLAMA31_STYLE_TEMPLATE,
                                                 tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        assert ours.apply_chat_template(TOOL_CONVERSATION, add_generation_prompt=add_generation_prompt,
                                        **extra) == expected


def test_raise_exception_becomes_tokenizer_error_with_the_message(tmp_path):
    ours = with_template(tmp_path, LLAMA2_TEMPLATE)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TokenizerError, match=r"^Conversation roles must alternate user/assistant"):
        ours.apply_chat_template(messages)


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__name__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append('x') }}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}",
    "{{ namespace(_x=1) }}",
])
def test_sandbox_escapes_raise_tokenizer_error(escape):
    with pytest.raises(TokenizerError, match="failed to render"):
        ChatTemplate(escape).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template, complaint", [
    ("{% if %}", "does not compile"),
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[0].content + 1 }}", "failed to render"),
    ("{{ undefined_thing.attribute }}", "failed to render"),
])
def test_broken_templates_raise_tokenizer_error(template, complaint):
    with pytest.raises(TokenizerError, match=complaint):
        ChatTemplate(template, origin="test").render([{"role": "user", "content": "hi"}])


def test_broken_template_file_is_named_at_load(tmp_path):
    copy_builtin_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for %}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "chat_template.jinja"))):
        load_tokenizer(tmp_path)


def test_jinja_file_wins_over_tokenizer_config(tmp_path):
    ours = with_template(tmp_path, "from the jinja file")
    assert ours.apply_chat_template(CONVERSATIONS["user_only"]) == "from the jinja file"


def test_named_template_list_picks_default(tmp_path):
    copy_builtin_tokenizer(tmp_path)
    write_json(tmp_path / "tokenizer_config.json", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]})
    assert load_tokenizer(tmp_path).apply_chat_template([]) == "plain"


def test_model_without_template_refuses_chat(tmp_path):
    copy_builtin_tokenizer(tmp_path)
    write_json(tmp_path / "tokenizer_config.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template(CONVERSATIONS["user_only"])


def test_list_content_needs_flattening_for_llama3(builtin):
    """Llama 3's template pipes content through `trim`, which would print a list of parts as its Python repr."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    as_string = builtin.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])
    assert builtin.apply_chat_template(messages) != as_string
    flattened = flatten_text_content(messages)
    assert flattened == [{"role": "user", "content": "Hello\nthere"}]
    assert messages[0]["content"][0] == {"type": "text", "text": "Hello"}
    assert builtin.apply_chat_template(flattened) == as_string


@pytest.mark.parametrize("messages, complaint", [
    ("just a string", "list"),
    ([["user", "hi"]], "message 0"),
    ([{"content": "no role"}], "role must be a string"),
    ([{"role": 3, "content": "x"}], "role must be a string"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "text"),
])
def test_flatten_rejects_other_shapes(messages, complaint):
    with pytest.raises(TokenizerError, match=complaint):
        flatten_text_content(messages)


def test_render_validates_messages():
    with pytest.raises(TokenizerError, match="message 1"):
        ChatTemplate("x").render([{"role": "user"}, "not a message"])


@pytest.mark.parity
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no_tools", "tools"])
def test_builtin_template_renders_tool_conversations_like_transformers(reference, tools, add_generation_prompt):
    ours = load_tokenizer(BUILTIN_DIR)
    expected = reference.apply_chat_template(TOOL_CONVERSATION, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(TOOL_CONVERSATION, add_generation_prompt=add_generation_prompt,
                                    tools=tools) == expected
    assert ('{"name": "get_weather", "parameters": {"city": "Zürich"}}' in expected) and (
        ("Environment: ipython" in expected) == (tools is not None))
