"""Speculative decoding's verification, inside the step: the target scores every draft and keeps the accepted run.

A sequence row that brings k drafts computes k + 1 tokens: its last known token and the drafts. The logits at
these k + 1 tokens are the target's distributions for positions j = 0..k of the run (position j follows draft j,
the known token for j = 0). Acceptance, per row, left to right:

- greedy rows accept draft j + 1 while it is the argmax at position j: the output is what greedy decoding without
  drafts would give, token for token;
- sampled rows accept draft j + 1 with probability p_j(draft) (the standard rule min(1, p/q) with q one-hot, as for
  proposals that are not drawn from a distribution: n-gram lookup), where p_j is the row's tempered, truncated
  distribution. At the first rejection the token is drawn from the residual, p_j without the draft, renormalised;
  with every draft accepted one more is drawn from p_k. Each emitted token then has exactly the target's
  distribution: P(draft) = p(draft), and any other x has (1 - p(draft)) · p(x) / (1 - p(draft)) = p(x).

So a row emits its accepted drafts and one token more, 1 to k + 1 tokens per step. Draws use the row's key folded
with its step + j, so a row without drafts draws exactly as `sampler.sample` would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.sampler import (SamplerOutput, SamplingTensors, describe_tokens, gumbel_noise, row_keys,
                                     target_logits, tempered_logits)
from jaxserve.schedule import ScheduledSequence

_ACCEPT_STREAM = 1  # folded into a draw's key for its acceptance test, apart from its Gumbel noise


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftArrays:
    """The drafts of a step's rows, padded to the bucket's S rows and K drafts; a row without drafts samples once."""

    token_ids: jax.Array  # i32[S, K]: each row's drafts; 0 past num_drafts
    num_drafts: jax.Array  # i32[S]: drafts the row brings (0..K)
    logits_index: jax.Array  # i32[S, K + 1]: the step token whose logits give position j; the row's last past drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifiedDrafts:
    """Per row: how many drafts were accepted, and the accepted drafts' log-probabilities under the target."""

    num_accepted: jax.Array  # i32[S]
    accepted: SamplerOutput  # leaves [S, K, ...]: entry j describes draft j + 1; meaningful for j < num_accepted


def build_draft_arrays(chunks: Sequence[ScheduledSequence], last_token: np.ndarray, num_rows: int,
                       num_drafts: int) -> DraftArrays:
    """Host arrays for `chunks`, whose last tokens sit at `last_token` (i32[n], indices in the step's tokens)."""
    n = len(chunks)
    counts = np.zeros(num_rows, np.int32)
    counts[:n] = np.fromiter((c.num_draft_tokens for c in chunks), np.int32, n)
    token_ids = np.zeros((num_rows, num_drafts), np.int32)
    for row, chunk in enumerate(chunks):
        token_ids[row, :chunk.num_draft_tokens] = chunk.draft_token_ids
    # The known token precedes the drafts: position j of the run is token last - drafts + j, capped at the last.
    first = np.zeros(num_rows, np.int32)
    first[:n] = last_token - counts[:n]
    offsets = np.minimum(np.arange(num_drafts + 1, dtype=np.int32)[None, :], counts[:, None])  # i32[S, K + 1]
    return DraftArrays(token_ids=token_ids, num_drafts=counts, logits_index=first[:, None] + offsets)


def verify_drafts(logits: jax.Array, drafts: DraftArrays, tensors: SamplingTensors,
                  num_top_logprobs: int) -> tuple[SamplerOutput, VerifiedDrafts]:
    """logits f32[S * (K + 1), V], row-major by (row, position); returns each row's last emitted token (the
    correction, or the bonus token when every draft was accepted) and its accepted drafts."""
    rows, width = drafts.logits_index.shape  # S, K + 1
    positions = jnp.tile(jnp.arange(width, dtype=jnp.int32), rows)  # i32[R], R = S * (K + 1)
    expanded = _per_position(tensors, width, positions)
    raw_logprobs, processed = target_logits(logits, expanded)  # f32[R, V]
    # The draft each position tests: draft j + 1 at position j; -1 where the row has no more.
    padded = jnp.pad(drafts.token_ids, ((0, 0), (0, 1)), constant_values=-1)  # i32[S, K + 1]
    tested = jnp.where(jnp.arange(width)[None, :] < drafts.num_drafts[:, None], padded, -1).reshape(-1)  # i32[R]
    argmax = jnp.argmax(processed, axis=-1)  # i32[R]
    # Tempering sorts every row of the vocabulary: a batch of greedy rows only (the common case) skips it.
    sampled_accepts, drawn = jax.lax.cond(jnp.all(expanded.greedy), _greedy_only, _rejection_sampling, processed,
                                          expanded, tested)  # bool[R], i32[R]
    accepted = (tested >= 0) & jnp.where(expanded.greedy, argmax == tested, sampled_accepts)  # bool[R]
    num_accepted = jnp.sum(jnp.cumprod(accepted.reshape(rows, width), axis=1), axis=1).astype(jnp.int32)  # i32[S]
    own = jnp.where(expanded.greedy, argmax, drawn).reshape(rows, width)  # i32[S, K + 1]
    emitted = jnp.where(jnp.arange(width)[None, :] < num_accepted[:, None], padded, own)  # i32[S, K + 1]
    described = describe_tokens(raw_logprobs, emitted.reshape(-1).astype(jnp.int32), num_top_logprobs)
    by_position = jax.tree.map(lambda leaf: leaf.reshape(rows, width, *leaf.shape[1:]), described)
    last = jax.tree.map(lambda leaf: jnp.take_along_axis(
        leaf, num_accepted.reshape(rows, 1, *([1] * (leaf.ndim - 2))), axis=1)[:, 0], by_position)
    return last, VerifiedDrafts(num_accepted=num_accepted,
                                accepted=jax.tree.map(lambda leaf: leaf[:, :width - 1], by_position))


def _rejection_sampling(processed: jax.Array, tensors: SamplingTensors,
                        tested: jax.Array) -> tuple[jax.Array, jax.Array]:  # bool[R], i32[R]
    """Sampled rows: whether each tested draft passes (u < p(draft)), and the token drawn where the run stops: from
    the residual after a rejection, from the whole distribution past the drafts (the bonus token)."""
    scaled = tempered_logits(processed, tensors)  # f32[R, V]
    keys = row_keys(tensors)  # key[R]
    passes = _uniforms(keys) < _probability_of(scaled, tested)  # bool[R]
    residual = jnp.where(jnp.arange(scaled.shape[1])[None, :] == tested[:, None], -jnp.inf, scaled)  # f32[R, V]
    return passes, jnp.argmax(residual + gumbel_noise(keys, scaled.shape[1]), axis=-1).astype(jnp.int32)


def _greedy_only(processed: jax.Array, tensors: SamplingTensors, tested: jax.Array) -> tuple[jax.Array, jax.Array]:
    """No row samples: nothing to draw (greedy rows take the argmax)."""
    return jnp.zeros(tested.shape, jnp.bool_), jnp.zeros(tested.shape, jnp.int32)


def _per_position(tensors: SamplingTensors, width: int, positions: jax.Array) -> SamplingTensors:
    """Every row's settings repeated for its K + 1 positions, position j drawing as the row's step + j."""
    repeated = jax.tree.map(lambda leaf: jnp.repeat(leaf, width, axis=0), tensors)
    return dataclasses.replace(repeated, steps=repeated.steps + positions)


def _uniforms(keys: jax.Array) -> jax.Array:  # f32[R] in [0, 1)
    return jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM)))(keys)


def _probability_of(scaled: jax.Array, token_ids: jax.Array) -> jax.Array:  # f32[R]: 0 where token_ids < 0
    probs = jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), jnp.maximum(token_ids, 0)[:, None],
                                        axis=-1)[:, 0])
    return jnp.where(token_ids >= 0, probs, 0.0)
