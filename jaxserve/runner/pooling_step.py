"""The pooling step (`--runner pooling`): layers over the step's prompt chunks, then, per chunk, what pooling needs
of its final-norm hidden states instead of logits and a sample.

Prompt chunks arrive as in a generating engine (runner/step.py): one flattened ragged batch padded to a bucket,
the KV pool donated, each chunk attending over its earlier chunks' pages. Per chunk row the program returns one
f32[hidden] vector:

- LAST pooling: the hidden state of the chunk's last token (only the prompt's final chunk's is used);
- MEAN pooling: the sum of the chunk's tokens' hidden states, which the engine adds up over a long prompt's
  chunks on the host and divides by its length (engine/pooling_engine.py).

The sum is a segment sum (float32 additions), not a one-hot matrix product, which a GPU may run in TF32. The tests
hold the result to HF transformers' pooled hidden states (tests/test_embeddings.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, PagedKVCache
from jaxserve.runner.buckets import StepBucket
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.paged_inputs import ChunkLayout, build_metadata
from jaxserve.schedule import ScheduledSequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolingArrays:
    """Everything a pooling step reads besides weights and pool, padded to its bucket (T tokens, S rows)."""

    token_ids: jax.Array  # i32[T]: the prompt tokens to compute; 0 for padding
    positions: jax.Array  # i32[T]: each token's position in its prompt
    metadata: PagedAttentionMetadata  # where tokens write their K/V and what they attend to
    token_rows: jax.Array  # i32[T]: each token's chunk row; S for padding, which the segment sum drops
    last_index: jax.Array  # i32[S]: index in the step of each row's last token (0 for padding rows)


def pooling_arrays(chunks: Sequence[ScheduledSequence], bucket: StepBucket, max_pages: int,
                   page_size: int) -> PoolingArrays:
    """The padded host inputs of a pooling step of `chunks` (numpy; none of them carries a pending token)."""
    layout = ChunkLayout.of(chunks)
    total = layout.num_tokens
    token_ids = np.zeros(bucket.num_tokens, np.int32)
    token_ids[:total] = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, total)
    if (token_ids[:total] < 0).any():
        raise ValueError("a pooling step computes known prompt tokens only")
    token_rows = np.full(bucket.num_tokens, bucket.num_seqs, np.int32)
    token_rows[:total] = layout.token_rows
    last_index = np.zeros(bucket.num_seqs, np.int32)
    last_index[:len(chunks)] = layout.last_token
    inputs = build_metadata(chunks, num_tokens=bucket.num_tokens, num_seqs=bucket.num_seqs, max_pages=max_pages,
                            page_size=page_size, layout=layout)
    return PoolingArrays(token_ids=token_ids, positions=inputs.positions, metadata=inputs.metadata,
                         token_rows=token_rows, last_index=last_index)


def run_packed_pooling(graphdef: nnx.GraphDef, params: nnx.State,
                       pool: PagedKVCache,  # without metadata; donated
                       packed: jax.Array,  # i32[layout.size]: the step's PoolingArrays in one buffer
                       layout: PackedLayout,  # static: the bucket's
                       mean: bool,  # static: MEAN pooling (each row's sum) rather than LAST (each row's last token)
                       ) -> tuple[jax.Array, PagedKVCache]:  # f32[S, hidden] per row, the pool
    """The pooling step program: the layers, then each chunk row's pooled vector."""
    arrays: PoolingArrays = layout.unpack(packed)
    model = nnx.merge(graphdef, params)
    with jax.named_scope("layers"):
        step_pool = pool.with_metadata(arrays.metadata, arrays.positions, model.config.num_attention_heads)
        hidden, pool = model(arrays.token_ids[None], arrays.positions[None], step_pool)
    hidden = hidden[0].astype(jnp.float32)  # f32[T, hidden]: the final norm's output, as HF's last_hidden_state
    num_rows = arrays.last_index.shape[0]
    with jax.named_scope("pool"):
        if mean:
            pooled = jax.ops.segment_sum(hidden, arrays.token_rows, num_segments=num_rows)  # f32[S, hidden]
        else:
            pooled = hidden[arrays.last_index]  # f32[S, hidden]
    return pooled, pool.without_metadata()


class PendingPooling:
    """A dispatched pooling step; `fetch` waits for its rows' vectors (the step's one host sync)."""

    def __init__(self, pooled: jax.Array,  # f32[S, hidden], on the device
                 num_rows: int):
        self._pooled = pooled
        self._num_rows = num_rows  # real rows: the step's chunks, in order
        pooled.copy_to_host_async()

    def fetch(self) -> np.ndarray:  # f32[num_rows, hidden]: row i is the step's i-th chunk's
        with jax.profiler.TraceAnnotation("read_back"):
            return np.asarray(jax.device_get(self._pooled))[:self._num_rows]
