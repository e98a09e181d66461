"""The models whose programs are audited without their weights: config.json contents of real models' shapes, and
which one a preset serves.

The GPU presets leave `model` unset (the weights' folder is given when serving), so the audit names the shapes
instead: by `--model-shape`, by a model folder's config.json (`--model DIR`, weights never read), or from the
preset's file name (configs/llama-3.1-8b-h100.yaml serves llama-3.1-8b, configs/tiny-cpu.yaml the
built-in tiny model).
"""

from __future__ import annotations

from pathlib import Path

from jaxserve.errors import ConfigError
from jaxserve.model.config import read_config_json

# Llama-3.1-8B's config.json (the fields the model reads).
LLAMA_31_8B = {
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
# Llama-3.1-70B's: wider and deeper, the same vocabulary and KV heads.
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64}

# The built-in tiny random model's (jaxserve/builtin), which configs/tiny-cpu.yaml serves.
TINY = read_config_json(Path(__file__).resolve().parents[1] / "builtin" / "config.json")

MODEL_SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "llama-3.1-70b": LLAMA_31_70B, "tiny": TINY}


def model_shape(name: str | None, preset: Path | None, model_dir: str | None = None) -> tuple[str, dict]:
    """(name, config.json contents) of the shapes `name` gives, else of the model folder's config.json (its weights
    are never read; a pre-quantized checkpoint's quantization_config decides the weights' format), else of the model
    the preset's name begins with; ConfigError naming the choices when none says."""
    if name is None and model_dir is not None:
        return Path(model_dir).name, read_config_json(Path(model_dir) / "config.json")
    if name is None and preset is not None:
        name = next((shape for shape in MODEL_SHAPES if Path(preset).stem.startswith(shape)), None)
    if name not in MODEL_SHAPES:
        raise ConfigError(f"which model's programs? pass --model-shape ({', '.join(MODEL_SHAPES)}), --model DIR, or "
                          f"a preset named after one (configs/llama-3.1-8b-h100.yaml)"
                          + (f"; {name!r} is not one" if name is not None else ""))
    return name, MODEL_SHAPES[name]
