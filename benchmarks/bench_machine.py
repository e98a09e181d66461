"""What a benchmark ran on, recorded beside its figures."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax


def machine_description() -> dict[str, Any]:
    """Platform, core count and the JAX device the figures come from."""
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
    }
