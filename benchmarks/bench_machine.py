"""What a benchmark ran on, recorded beside its figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import jax


def machine_description() -> dict[str, Any]:
    """Platform, CPU model and core count, and the JAX device the figures come from."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
    }


def cpu_model() -> str:
    """The CPU's model name (host-side figures depend on it), from /proc/cpuinfo where there is one."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"
