"""The built-in model: a tiny Llama whose weights are generated, so jaxserve runs with no download at all.

Its weights are deterministic random noise (seed 0, normal with std 0.2), so its output is fluent-looking gibberish:
it exists to exercise the whole serving path (tokenizer, scheduler, KV cache, sampling, HTTP) in demos and tests,
not to answer questions. Config and tokenizer files live in `jaxserve/builtin/`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.param_names import is_stacked
from jaxserve.parallel import TensorParallelLayout

BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "builtin"
BUILTIN_SEED = 0
# Much larger than a trained model's scale, so logits are peaked rather than flat and sampling is not uniform.
BUILTIN_INIT_STD = 0.2


def random_params(cfg: LlamaConfig, dtype: np.dtype, seed: int, init_std: float) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and freshly drawn parameters on the default device, deterministic for a given seed."""
    model = LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), init_std=init_std)
    return nnx.split(model, nnx.Param)


def sharded_random_params(layout: TensorParallelLayout, dtype: np.dtype, seed: int,
                          init_std: float) -> tuple[nnx.GraphDef, nnx.State]:
    """`random_params` of the layout's checkpoint config, laid out as the layout says (KV heads repeated, sharded).

    Drawn inside one jit whose outputs carry the rules' shardings, so each device computes and keeps its shards
    only; JAX's threefry is partitionable, so the numbers are the same for every sharding, and for any mesh size.
    """
    placed = abstract_params(layout.model_config, dtype, layout.param_sharding)

    def draw() -> dict[str, jax.Array]:
        _, state = random_params(layout.checkpoint_config, dtype, seed, init_std)
        return {name: _repeat_rows(name, value, layout.stored_rows(name)) for name, value in flat_arrays(state).items()}

    arrays = jax.jit(draw, out_shardings={name: spec.sharding for name, spec in placed.specs.items()})()
    return placed.graphdef, fill_params(placed, arrays)


def builtin_params(layout: TensorParallelLayout, dtype: np.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The built-in model's parameters: the same noise on every run."""
    return sharded_random_params(layout, dtype, BUILTIN_SEED, BUILTIN_INIT_STD)


def _repeat_rows(name: str, value: jax.Array, stored_rows: np.ndarray | None) -> jax.Array:
    """f[placed rows, ...] from f[stored rows, ...] (rows after the layer axis of a stacked parameter), rows copied
    as stored_rows (i64[placed rows]) says."""
    if stored_rows is None:
        return value
    return value[:, stored_rows] if is_stacked(name) else value[stored_rows]
