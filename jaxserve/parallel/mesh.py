"""The device mesh of tensor parallelism: one named axis, "tp", over the first N local devices.

The axis is `AxisType.Auto` (JAX 0.11's `jax.make_mesh` defaults to Explicit, under which Megatron-style weights
raise "Contracting dimensions are sharded"): jit then lets XLA's SPMD partitioner place the collectives that
column- and row-parallel weights imply.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from jaxserve.errors import ConfigError

TP_AXIS = "tp"  # the mesh axis that weights, KV heads and the pool are split over


def make_tp_mesh(tensor_parallel_size: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over the first `tensor_parallel_size` of `devices` (default: this process's devices).

    Raises ConfigError when the size is not positive or more devices are asked for than exist.
    """
    check_positive_size(tensor_parallel_size)
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ConfigError(f"tensor_parallel_size {tensor_parallel_size} needs that many devices, but JAX sees "
                          f"{len(devices)} ({devices[0].platform})")
    return jax.make_mesh((tensor_parallel_size,), (TP_AXIS,), axis_types=(AxisType.Auto,),
                         devices=devices[:tensor_parallel_size])


def check_positive_size(tensor_parallel_size: int) -> None:
    """Raise ConfigError unless the size is a positive integer."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
