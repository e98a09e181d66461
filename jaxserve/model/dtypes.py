"""Which floating-point type the weights and activations use, from the user's `--dtype` and the checkpoint.

`auto` keeps the checkpoint's own dtype on accelerators (as vLLM does for bfloat16 and float16 checkpoints) and
uses float32 on CPU, where bfloat16 and float16 matmuls are emulated and slower than float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.errors import ModelLoadError

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")

_DTYPES_BY_NAME = {
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "float": jnp.float32,
}


def resolve_dtype(requested: str, checkpoint_dtype: str, platform: str) -> np.dtype:
    """The dtype to load and run the model in.

    `requested` is what the user asked for (`auto` or a name such as `bf16`), `checkpoint_dtype` the dtype
    config.json declares, and `platform` the JAX backend (`jax.default_backend()`: "cpu", "gpu", "tpu").
    """
    if requested.strip().lower() != "auto":
        return parse_dtype(requested)
    if platform == "cpu":
        return jnp.dtype(jnp.float32)
    try:
        return parse_dtype(checkpoint_dtype)
    except ModelLoadError:
        raise ModelLoadError(
            f"config.json declares dtype {checkpoint_dtype!r}, which jaxserve cannot run; "
            f"choose one explicitly ({', '.join(DTYPE_CHOICES[1:])})"
        ) from None


def parse_dtype(name: str) -> np.dtype:
    """The dtype a name such as `bfloat16`, `bf16`, `fp16` or `float` stands for (case-insensitive)."""
    try:
        return jnp.dtype(_DTYPES_BY_NAME[name.strip().lower()])
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r} (choose {', '.join(DTYPE_CHOICES)})") from None
