"""The built-in model: a tiny Llama whose weights are generated, so jaxserve runs with no download at all.

Its weights are deterministic random noise (seed 0, normal with std 0.2), so its output is fluent-looking gibberish:
it exists to exercise the whole serving path (tokenizer, scheduler, KV cache, sampling, HTTP) in demos and tests,
not to answer questions. Config and tokenizer files live in `jaxserve/builtin/`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM

BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_SEED = 0
# Much larger than a trained model's scale, so logits are peaked rather than flat and sampling is not uniform.
BUILTIN_INIT_STD = 0.2


def random_params(cfg: LlamaConfig, dtype: np.dtype, seed: int, init_std: float) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and freshly drawn parameters on the default device, deterministic for a given seed."""
    model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), init_std=init_std)
    return nnx.split(model, nnx.Param)


def builtin_params(cfg: LlamaConfig, dtype: np.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The built-in model's parameters: the same noise on every run."""
    return random_params(cfg, dtype, BUILTIN_SEED, BUILTIN_INIT_STD)
