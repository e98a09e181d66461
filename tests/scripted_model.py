"""A tiny Qwen3 folder whose greedy answer is a script: a reasoning model, so a live server shows what its reasoning
and tool-call parsers make of a known answer.

The model is a bigram table in transformer form: every decoder layer's o_proj and down_proj are zero, so the last
hidden state is the current token's (RMS-normed) embedding, and lm_head's row of token v is the sum of the normed
embeddings of the tokens the script follows with v. The normed embedding of one token has squared length `hidden`
(64) and random others meet it at about ±8, so greedy decoding follows the table by a wide margin. The tokenizer is
the built-in one plus `<think>`, `</think>`, `<tool_call>` and `</tool_call>` (ordinary added tokens, as in Qwen's), and
the chat template is Qwen3's.

After the generation prompt's last token ("\\n") the model answers `<think> themm</think>\\n\\nhello`; with
`enable_thinking: false` the prompt ends in "\\n\\n" and it answers `hello`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.safetensors_writer import save_safetensors_folder
from tests.chat_templates import QWEN3

ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # ids 512.. in this order
THINK, THINK_END = 512, 513
VOCAB = 512 + len(ADDED_TOKENS)
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 2, 4, 2, 16, 128
EOS = 511  # the built-in tokenizer's <|eot_id|>
NEWLINE, TWO_NEWLINES = 198, 412  # "\n" (ends the generation prompt), "\n\n" (ends it without thinking)
# token -> the token the script writes after it: <think> " the" "mm" </think> "\n\n" "he" "l" "lo" <eot>
SCRIPT = {NEWLINE: THINK, THINK: 259, 259: 398, 398: THINK_END, THINK_END: TWO_NEWLINES, TWO_NEWLINES: 258, 258: 75,
          75: 344, 344: EOS}
REASONING, CONTENT = " themm", "\n\nhello"  # what the script's answer says, as text
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048, "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "torch_dtype": "float32", "eos_token_id": EOS,
}


def write_scripted_qwen3(folder: Path, seed: int = 0) -> Path:
    """The folder: config, weights, tokenizer (built-in plus ADDED_TOKENS) and Qwen3's chat template."""
    rng = np.random.default_rng(seed)
    embeddings = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    save_safetensors_folder(folder, CONFIG, {**_outer_tensors(embeddings), **_layer_tensors(rng)})
    _write_tokenizer(folder)
    return folder


def _outer_tensors(embeddings: np.ndarray) -> dict[str, np.ndarray]:
    normed = embeddings / np.sqrt(np.mean(embeddings ** 2, axis=1, keepdims=True))  # f32[vocab, hidden]
    lm_head = np.zeros_like(embeddings)
    for token, following in SCRIPT.items():
        lm_head[following] += normed[token]
    return {"model.embed_tokens.weight": embeddings, "model.norm.weight": np.ones(HIDDEN, np.float32),
            "lm_head.weight": lm_head}


def _layer_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random attention and MLP inputs, zero outputs: each layer adds nothing to the residual stream."""
    def draw(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    shapes = {"self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
              "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN)}
    tensors = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors.update({prefix + name: draw(*shape) for name, shape in shapes.items()})
        tensors[prefix + "self_attn.o_proj.weight"] = np.zeros((HIDDEN, HEADS * HEAD_DIM), np.float32)
        tensors[prefix + "mlp.down_proj.weight"] = np.zeros((HIDDEN, INTERMEDIATE), np.float32)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[prefix + norm + ".weight"] = np.ones(HIDDEN, np.float32)
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            tensors[prefix + norm + ".weight"] = np.ones(HEAD_DIM, np.float32)
    return tensors


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(BUILTIN_MODEL_DIR / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in ADDED_TOKENS])
    assert [tokenizer.token_to_id(text) for text in ADDED_TOKENS] == list(range(512, VOCAB))
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = json.loads((BUILTIN_MODEL_DIR / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": QWEN3}, indent=2))
    shutil.copy(BUILTIN_MODEL_DIR / "generation_config.json", folder / "generation_config.json")
