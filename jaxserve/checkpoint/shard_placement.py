"""Build a device array from a host tensor one device slice at a time, so no device receives more than its shard.

Sources are anything indexed like numpy: safetensors slices (`safe_open(...).get_slice(name)`, which read only the
requested bytes from the memory-mapped file) or host arrays (Orbax's read buffers), one per checkpoint tensor the
parameter is made of. Each device's callback reads just its index; a stacked parameter's shard is read layer by
layer straight into one host buffer (so the stacked tensor is never whole on the host), and rows of KV projections
repeated for tensor parallelism are gathered from the stored rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxserve.checkpoint.param_tree import TensorTarget


def place_tensor(sources: Sequence[Any], target: TensorTarget) -> jax.Array:
    """The device array `target.placed` describes, filled shard by shard from `sources` (one per entry of
    `target.sources`, in the stored layout) on the host.

    Casting happens per shard on the host, so the device never holds the stored dtype beside the target one.
    Devices holding the same slice (replicas) share one read. A target with a `convert` reads each source whole
    first and transforms it (small tensors only: scales).
    """
    placed = target.placed
    if target.source_converts is not None:
        sources = [convert(np.asarray(source[:])) for convert, source in zip(target.source_converts, sources)]
    elif target.convert is not None:
        sources = [target.convert(np.asarray(source[:])) for source in sources]
    shards: dict[tuple[slice, ...], np.ndarray] = {}  # index -> its host shard, cast (slices hash from Python 3.12)

    def read_device_shard(index: tuple[slice, ...]) -> np.ndarray:
        if index not in shards:
            shards[index] = (_read_stacked_shard(sources, index, target) if target.stacked
                             else read_shard(sources[0], index, target.stored_rows).astype(placed.dtype, copy=False))
        return shards[index]

    return jax.make_array_from_callback(placed.shape, placed.sharding, read_device_shard)


def _read_stacked_shard(sources: Sequence[Any], index: tuple[slice, ...], target: TensorTarget) -> np.ndarray:
    """`placed[index]` of a stacked parameter: its layers' shards written (and cast) into one buffer as read."""
    layers = range(len(sources))[index[0]]
    shard = None
    for position, layer in enumerate(layers):
        layer_shard = read_shard(sources[layer], index[1:], target.stored_rows)
        if shard is None:
            shard = np.empty((len(layers), *layer_shard.shape), target.placed.dtype)
        shard[position] = layer_shard
    return shard


def read_shard(source: Any, index: tuple[slice, ...], stored_rows: np.ndarray | None) -> np.ndarray:
    """`placed[index]` read from `source`; `stored_rows` (i64[placed rows]) maps placed rows to stored ones.

    Repeated rows are read as the one contiguous stored span that covers them, then picked out on the host.
    """
    if stored_rows is None:
        return np.asarray(source[index])
    rows = stored_rows[index[0]]  # i64[rows of this shard]
    first, last = int(rows.min()), int(rows.max())
    span = np.asarray(source[(slice(first, last + 1), *index[1:])])
    return span[rows - first]
