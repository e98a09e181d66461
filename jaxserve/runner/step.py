"""The jitted engine step: embeddings → layers over the paged pool → logits at the sampled rows → sampling.

A pure function of (weights, pool, step arrays); the pool is donated, so the KV writes happen in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, PagedKVCache
from jaxserve.runner.sampler import SamplerOutput, SamplingTensors, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Everything one step reads besides weights and pool, padded to its bucket (T tokens, S sequence rows)."""

    token_ids: jax.Array  # i32[T]: the tokens to compute; ignored where pending_rows >= 0
    pending_rows: jax.Array  # i32[T]: row of the previous step's samples holding this token's id, or -1
    positions: jax.Array  # i32[T]: each token's position in its sequence
    metadata: PagedAttentionMetadata  # where tokens write and what they attend to
    sample_index: jax.Array  # i32[S]: the token whose logits row s samples (the last of its chunk)
    sampling: SamplingTensors  # per-row sampling settings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step leaves on the device."""

    sampled: SamplerOutput  # one sampled token (with log-probabilities) per sequence row
    last_tokens: jax.Array  # i32[max_rows]: sampled ids padded to a fixed width, fed to the next step's pending tokens


def run_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    pool: PagedKVCache,  # without metadata; donated
    previous_tokens: jax.Array,  # i32[max_rows]: the previous step's last_tokens
    arrays: StepArrays,
    num_top_logprobs: int,  # static
) -> tuple[StepResult, PagedKVCache]:
    model = nnx.merge(graphdef, params)
    tokens = jnp.where(arrays.pending_rows >= 0, previous_tokens[jnp.maximum(arrays.pending_rows, 0)],
                       arrays.token_ids)  # i32[T]
    with jax.named_scope("layers"):
        hidden, pool = model(tokens[None], arrays.positions[None], pool.with_metadata(arrays.metadata))
    with jax.named_scope("logits"):
        logits = model.logits(hidden[0, arrays.sample_index])  # f32[S, vocab]
    with jax.named_scope("sample"):
        sampled = sample(logits, arrays.sampling, num_top_logprobs)
    last_tokens = jnp.zeros_like(previous_tokens).at[: sampled.token_ids.shape[0]].set(sampled.token_ids)
    return StepResult(sampled=sampled, last_tokens=last_tokens), pool.without_metadata()
