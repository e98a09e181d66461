"""Regenerate the built-in tiny model's tokenizer: jaxserve/builtin/tokenizer.json and tokenizer_config.json.

A byte-level BPE shaped like Llama 3's (same pre-tokenizer split, byte-level decoder, <|begin_of_text|> prepended by
the post-processor, the same special token names at the end of the vocabulary), trained on the fixed corpus below.
The vocabulary is exactly 512 ids, matching the built-in model's embedding table. Training is deterministic, so
running this again writes byte-identical files:

    .venv/bin/python tools/make_builtin_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"  # what an instruct model ends its turn with, as in Llama 3 Instruct's tokenizer_config.json
OUTPUT_DIR = Path(__file__).resolve().parent.parent / "jaxserve" / "builtin"

# Llama 3's pre-tokenizer split: contractions, words with one leading non-letter, numbers in groups of up to three
# digits, punctuation runs, newlines, and whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# Meta Llama 3 Instruct's chat template, extended with Llama 3.1's JSON tool calling: without tools it renders
# exactly as Meta's; with tools, a system turn lists them and asks for calls as {"name": ..., "parameters": ...},
# assistant calls are written that way (several joined by "; ") and tool results come back as ipython turns.
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n' }}
    {{- 'To call a function, answer with a JSON object {"name": function name, "parameters": its arguments}.\n\n' }}
    {%- for tool in tools %}
        {{- tool | tojson + '\n\n' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {{- (message.content if message.content is string else message.content | tojson) + '<|eot_id|>' }}
    {%- elif message.tool_calls is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
            {%- if not loop.last %}{{- '; ' }}{%- endif %}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Hello! How can I help you today? I answer questions about science, history, language and programming.",
    "The user asked how a language model works. A model reads a prompt as a sequence of "
    "tokens, predicts the next token, and repeats until it reaches the end of its answer or a length limit.",
    "Once upon a time there was a little town by the sea. Every morning the fishermen went out in their boats, and "
    "every evening they came back with stories about the weather, the waves and the birds.",
    "In 1969 two astronauts walked on the Moon. The mission lasted eight days, and about 600 million people "
    "watched the first steps on television.",
    "Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees. The Earth is about 150 million "
    "kilometres from the Sun, and light from the Sun takes a little more than 8 minutes to reach us.",
    "def greet(name):\n    return f\"Hello, {name}!\"\n\nfor i in range(10):\n    print(greet(str(i)))\n",
    "import json\n\nwith open(\"config.json\") as f:\n    config = json.load(f)\nprint(config[\"vocab_size\"])\n",
    "Please write a short poem about the ocean. The ocean is wide and deep; it keeps the secrets of the ships that "
    "sleep beneath its waves.",
    "What is the capital of France? The capital of France is Paris. What is the capital of Japan? It is Tokyo.",
    "Good morning, everyone. Today we will talk about the history of the printing press, which changed the way "
    "people shared ideas, news and knowledge across the world.",
    "System: answer in one line. User: summarize the text below in one sentence. Reply: the text "
    "describes how rivers shape valleys over thousands of years.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14 2.718 -7 +12 50% $20 #1 @home",
    "Punctuation and symbols: ( ) [ ] { } < > , . ; : ! ? ' \" - _ = + * / \\ | & ^ ~ ` %",
    "She said that she would come back later, but nobody knew when. They waited and waited, and then it was night.",
    "Learning is not attained by chance; it must be sought for with ardor and attended to with diligence.",
)


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on CORPUS and give it Llama 3's special tokens and post-processor."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1", special_tokens=[(BOS_TOKEN, bos_id)]
        ),
    ])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise SystemExit(f"trained vocabulary has {tokenizer.get_vocab_size()} ids, expected {VOCAB_SIZE}; "
                         "the corpus is too small for the requested merges")
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json in the shape of Llama 3 Instruct's: BOS comes from the post-processor, not a flag."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def main() -> None:
    tokenizer = build_tokenizer()
    (OUTPUT_DIR / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (OUTPUT_DIR / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    print(f"wrote {OUTPUT_DIR}: {VOCAB_SIZE} ids, special tokens {special_ids}")


if __name__ == "__main__":
    main()
