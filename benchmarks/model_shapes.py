"""Model configs (config.json contents) the benchmarks build random models of: real models' shapes, no weights."""

import json

# Llama-3.1-8B's shapes.
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Llama-3.1-70B's shapes.
LLAMA3_70B_CONFIG = {**LLAMA3_8B_CONFIG, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                     "num_attention_heads": 64}


def model_config(name: str) -> dict:
    """The config of a model the benchmarks name: "llama-3.1-8b", "llama-3.1-70b" or "builtin" (the built-in tiny
    model's own config)."""
    if name == "builtin":
        from jaxserve.checkpoint import BUILTIN_MODEL_DIR  # here: the real models' shapes need no jaxserve

        return json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())
    return {"llama-3.1-8b": LLAMA3_8B_CONFIG, "llama-3.1-70b": LLAMA3_70B_CONFIG}[name]
