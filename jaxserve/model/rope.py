"""Rotary position embeddings in HF's rotate-half convention (dimension i pairs with i + head_dim/2).

HF Llama checkpoints permute q/k rows for this convention, so applying Meta's interleaved pairing to them would be
wrong; see FIELD-NOTES.
"""

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:  # f32[head_dim // 2]
    """Per-pair angular frequencies, with the checkpoint's context-extension scaling applied."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:  # f32[head_dim // 2]
    """Llama 3.1's rule: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    original = rope.original_max_position_embeddings
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def rotary_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables f32[..., head_dim] for integer positions i32[...]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # f32[..., head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # f32[..., head_dim]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x f[..., tokens, heads, head_dim] by tables f32[..., tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated_half * sin
