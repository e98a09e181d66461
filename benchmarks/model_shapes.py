"""Model configs (config.json contents) the benchmarks build random models of: real models' shapes, no weights; and
the model a benchmark's `--model-shape` names, built in memory (random weights straight on the device)."""

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


# What `--model-shape` offers where one device holds the model: the built-in tiny model, or random weights of
# Llama-3.1-8B's shapes (16 GB in bfloat16).
ENGINE_SHAPES = ("builtin", "llama-3.1-8b")


def model_of_shape(shape: str, dtype: str, seed: int):
    """The built-in model ("builtin"), or random weights of the shapes `shape` names (`random_model`). Returns a
    jaxserve LoadedModel, as LLMEngine takes it."""
    if shape == "builtin":
        from jaxserve.checkpoint import load_model  # here: the configs above need no jaxserve

        return load_model(None, dtype, progress=False)
    return random_model(model_config(shape), dtype, seed)


def random_model(config: dict, dtype: str, seed: int):
    """Random weights of the shapes `config` (config.json's contents) gives, drawn on the device at a trained model's
    scale (no checkpoint on disk); `dtype` as --dtype takes it ("auto": the config's dtype, float32 on the CPU). The
    built-in tokenizer serves: prompts are token ids, and ids past its vocabulary decode to nothing."""
    import jax  # here: the configs above need no JAX

    from jaxserve.checkpoint import BUILTIN_MODEL_DIR, LoadedModel
    from jaxserve.checkpoint.builtin import random_params
    from jaxserve.model.config import LlamaConfig
    from jaxserve.model.dtypes import resolve_dtype
    from engine_bench import ENGINE_INIT_STD  # here: engine_bench imports this module

    llama = LlamaConfig.from_hf_dict(config)
    weights_dtype = resolve_dtype(dtype, llama.checkpoint_dtype, jax.default_backend())
    graphdef, params = random_params(llama, weights_dtype, seed, ENGINE_INIT_STD)
    return LoadedModel(llama, graphdef, params, weights_dtype, BUILTIN_MODEL_DIR, "random")
