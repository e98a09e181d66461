"""Tiny random Llama checkpoints (written by transformers, or without torch by jaxserve) and logits from both.

`tiny_hf_config`, `write_tiny_checkpoint`, `jaxserve_logits`, `random_tokens` and the comparison helpers
(`load_arrays`, `assert_same_tensors`, `edit_config`) need only jaxserve. Tests that
call `build_tiny_hf_llama` / `save_hf_llama` / `save_tiny_hf_llama` / `hf_logits` need the `parity` extra and must
`pytest.importorskip("torch")` and `pytest.importorskip("transformers")` first; this module imports both lazily so
that merely importing it never fails.

Styles (what each exercises):
    "llama2"   multi-head attention, default RoPE (theta 1e4)
    "llama31"  grouped-query attention, llama3 RoPE scaling with original_max_position_embeddings 16, so the
               scaling changes positions seen in a 40-token test
    "tied"     Llama 3.2: llama31 plus tie_word_embeddings (no lm_head.weight on disk)
Family styles (other architectures the one decoder serves; `build_tiny_hf_model` / `save_tiny_hf_model`):
    "qwen2"         Qwen2ForCausalLM: GQA, q/k/v biases (drawn at random: HF would leave them zero)
    "qwen2-window"  qwen2 with use_sliding_window: layer 1 attends over a 6-token window, layer 0 over everything
    "qwen3"         Qwen3ForCausalLM: q/k RMSNorm per head, explicit head_dim 32 (not hidden / heads), tied
                    embeddings as in the small Qwen3 sizes
    "mistral"       MistralForCausalLM: explicit head_dim 32 and a 6-token sliding window on every layer
Folder variants (keywords of `save_tiny_hf_llama`): `sharded=True` writes several shards plus an index;
`rope_keys="top_level"` rewrites config.json the way real Llama 3.1 repositories spell it (`rope_theta` and
`rope_scaling` at top level, `torch_dtype`) instead of transformers 5's `rope_parameters` and `dtype`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

STYLES = ("llama2", "llama31", "tied")
FAMILY_STYLES = ("qwen2", "qwen2-window", "qwen3", "mistral")
ROPE_KEY_STYLES = ("rope_parameters", "top_level")

_LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    # Ten times a trained model's scale, so logits are far from flat and a wrong weight shows up clearly.
    initializer_range=0.2,
)
_STYLE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama2": dict(num_key_value_heads=4, rope_theta=10000.0),
    "llama31": dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING),
    "tied": dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, tie_word_embeddings=True),
}
# style -> (transformers config class, its fields beyond _COMMON)
_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, rope_theta=1000000.0)),
    "qwen2-window": ("Qwen2Config", dict(num_key_value_heads=2, rope_theta=1000000.0, use_sliding_window=True,
                                         sliding_window=6, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                                  tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=32, sliding_window=6)),
}
# transformers' shard limits: the float32 tiny model is about 0.5 MB, so the first gives several shards.
_SMALL_SHARD = "100KB"
_ONE_FILE = "10GB"


def build_tiny_hf_llama(style: str = "llama31", seed: int = 0, **overrides: Any):
    """A random float32 `transformers.LlamaForCausalLM` in eval mode; `overrides` replace HF config fields.

    Norm weights are drawn around 1 rather than left at exactly 1, so loading them wrongly changes the logits.
    """
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(**{**_COMMON, **_STYLE_CONFIGS[style], **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    return model


def build_tiny_hf_model(style: str, seed: int = 0, **overrides: Any):
    """A random float32 transformers model of a Llama style (STYLES) or a family style (FAMILY_STYLES), eval mode.

    Norm weights (q/k norms included) are drawn around 1 and biases around 0, rather than left at HF's 1 and 0, so
    loading them wrongly (or not at all) changes the logits.
    """
    if style in STYLES:
        return build_tiny_hf_llama(style, seed, **overrides)
    import torch
    import transformers

    config_class, fields = _FAMILY_CONFIGS[style]
    hf_config = getattr(transformers, config_class)(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    return model


def save_tiny_hf_model(folder: Path, style: str, *, dtype: str = "float32", seed: int = 0, **overrides: Any):
    """Build a tiny random HF model of any style, save it into `folder`, and return it (float32, eval mode)."""
    model = build_tiny_hf_model(style, seed, **overrides)
    save_hf_llama(model, folder, dtype=dtype)
    return model


def save_hf_llama(
    model,
    folder: Path,
    *,
    sharded: bool = False,
    rope_keys: str = "rope_parameters",
    dtype: str = "float32",
) -> None:
    """`save_pretrained` into `folder` in the stored `dtype` (the passed model is left unchanged)."""
    import torch

    stored = model if dtype == "float32" else _copy_in_dtype(model, getattr(torch, dtype))
    stored.save_pretrained(folder, max_shard_size=_SMALL_SHARD if sharded else _ONE_FILE)
    if rope_keys == "top_level":
        _rewrite_config_with_top_level_rope(Path(folder) / "config.json")


def save_tiny_hf_llama(
    folder: Path,
    style: str = "llama31",
    *,
    sharded: bool = False,
    rope_keys: str = "rope_parameters",
    dtype: str = "float32",
    seed: int = 0,
    **overrides: Any,
):
    """Build a tiny random HF Llama of `style`, save it into `folder`, and return it (float32, eval mode)."""
    model = build_tiny_hf_llama(style, seed, **overrides)
    save_hf_llama(model, folder, sharded=sharded, rope_keys=rope_keys, dtype=dtype)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """f32[batch, tokens, vocab] from HF for i64[batch, tokens], all positions in one forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def jaxserve_logits(loaded, tokens: np.ndarray) -> np.ndarray:
    """f32[batch, tokens, vocab] from a `LoadedModel` for i[batch, tokens], one prefill through a dense cache."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.reference.dense_kv_cache import DenseKVCache

    cfg = loaded.config
    batch, length = tokens.shape
    model = nnx.merge(loaded.graphdef, loaded.params)
    cache = DenseKVCache.zeros(
        cfg.num_hidden_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim, loaded.dtype
    )
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    hidden, _ = model(jnp.asarray(tokens), positions, cache)
    return np.asarray(model.logits(hidden))


def random_tokens(vocab_size: int, length: int, seed: int = 0) -> np.ndarray:
    """i64[1, length] token ids drawn uniformly from the vocabulary."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(1, length))


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """The built-in model's config.json (Llama 3.1 style, vocab 512) with `overrides`; no torch needed."""
    from jaxserve.checkpoint import BUILTIN_MODEL_DIR

    return {**json.loads((BUILTIN_MODEL_DIR / "config.json").read_text()), **overrides}


def write_tiny_checkpoint(
    folder: Path,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> dict[str, np.ndarray]:
    """Write a random tiny Llama as safetensors with jaxserve's own writer (no torch) and return its tensors."""
    from jaxserve.checkpoint.safetensors_writer import save_random_llama

    return save_random_llama(folder, tiny_hf_config(**config_overrides), dtype, seed, max_shard_bytes=max_shard_bytes)


def edit_config(folder: Path, **changes: Any) -> None:
    """Overwrite fields of the folder's config.json, e.g. to make it disagree with the weights."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def load_arrays(folder: Path, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Checkpoint tensor name -> host copy of the loaded weights (stacked layers split back into HF's tensors)."""
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.param_tree import checkpoint_tensors, flat_arrays

    return checkpoint_tensors(flat_arrays(load_model(folder, dtype, progress=False).params))


def assert_same_tensors(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Same names, dtypes and bits."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def _copy_in_dtype(model, torch_dtype):
    import copy

    return copy.deepcopy(model).to(torch_dtype)


def _rewrite_config_with_top_level_rope(config_path: Path) -> None:
    """Move `rope_parameters` to top-level `rope_theta` / `rope_scaling`, and `dtype` to `torch_dtype`."""
    config = json.loads(config_path.read_text())
    if "rope_parameters" not in config:  # transformers 4 already writes the top-level style
        return
    rope = dict(config.pop("rope_parameters") or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    config_path.write_text(json.dumps(config, indent=2))
