"""The share of each GPU that JAX's allocator may claim, fixed before JAX starts.

JAX's GPU allocator never uses more than XLA_CLIENT_MEM_FRACTION of a device's memory (0.75 unless set), while
`gpu_memory_utilization` means a share of the whole device, as in vLLM. Left alone, a 0.9 utilization would get 0.9
of 0.75, and a model needing more than 75% of a GPU would not load. So the commands raise the allocator's share to
the utilization before JAX is imported (a fraction the operator set is kept), and pool sizing converts the
allocator's limit back into the device's memory. Imports no JAX: it must run first.
"""

from __future__ import annotations

import os

MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # current name, deprecated name
JAX_DEFAULT_MEM_FRACTION = 0.75  # what JAX's GPU allocator claims when neither variable is set


def claim_device_memory(gpu_memory_utilization: float) -> None:
    """Lets JAX's allocator use the utilization's share of each GPU; call before JAX initialises its backend."""
    if not any(os.environ.get(name) for name in MEM_FRACTION_VARS):
        os.environ[MEM_FRACTION_VARS[0]] = f"{gpu_memory_utilization:g}"


def allocator_fraction() -> float:
    """The share of device memory JAX's allocator was allowed when it started."""
    for name in MEM_FRACTION_VARS:
        if os.environ.get(name):
            return float(os.environ[name])
    return JAX_DEFAULT_MEM_FRACTION
