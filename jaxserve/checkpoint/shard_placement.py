"""Build a device array from a host tensor one device slice at a time, so no device receives more than its shard.

The source is anything indexed like numpy: a safetensors slice (`safe_open(...).get_slice(name)`, which reads only
the requested bytes from the memory-mapped file) or a host array (Orbax's read buffer). Each device's callback
reads just its index; rows of KV projections repeated for tensor parallelism are gathered from the stored rows.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxserve.checkpoint.param_tree import TensorTarget


def place_tensor(source: Any, target: TensorTarget) -> jax.Array:
    """The device array `target.placed` describes, filled shard by shard from `source` (stored layout) on the host.

    Casting happens per shard on the host, so the device never holds the stored dtype beside the target one.
    Devices holding the same slice (replicas) share one read.
    """
    placed = target.placed
    shards: dict[tuple[slice, ...], np.ndarray] = {}  # index -> its host shard, cast (slices hash from Python 3.12)

    def read_device_shard(index: tuple[slice, ...]) -> np.ndarray:
        if index not in shards:
            shards[index] = read_shard(source, index, target.stored_rows).astype(placed.dtype, copy=False)
        return shards[index]

    return jax.make_array_from_callback(placed.shape, placed.sharding, read_device_shard)


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
