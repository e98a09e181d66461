"""GPUs that are described rather than present: a target description (XLA's GpuTargetConfig as text, in
configs/gpu-targets/) turned into a topology of compile-only devices that XLA:GPU compiles for on any machine.

This needs JAX's CUDA plugin (the `gpu-audit` extra: jax[cuda12]) but no GPU and no driver, with JAX_PLATFORMS=cpu
keeping the CPU JAX's default backend while the plugin registers, and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 sparing the
CUDA libraries a version check that needs a driver. Both must be set before JAX starts its backends. Nothing can be
placed on these devices (`device_put` fails: "compile-only client"): programs are built from abstract arguments.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from pathlib import Path

from jaxserve.errors import ConfigError

TARGETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "gpu-targets"
# What JAX must see before it starts, for the CUDA plugin to register beside the CPU backend without a driver.
COMPILE_ENVIRONMENT = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
CUDA_PLUGIN_MISSING = ("JAX's CUDA plugin is not installed: compiling for a GPU target needs the gpu-audit extra "
                       "(pip install -e '.[gpu-audit]', which installs jax[cuda12]); no GPU or driver is needed")


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model as its target description gives it."""

    name: str  # "h100", "h200", or the description file's stem
    description: str  # the description's text, which XLA:GPU compiles against
    device_kind: str  # as its devices report it, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # device memory
    memory_bandwidth: float  # bytes per second, the spec figure the description holds


def cuda_plugin_installed() -> bool:
    """JAX's CUDA plugin can be imported (checked without importing JAX)."""
    return any(importlib.util.find_spec(name.rsplit(".", 1)[0]) is not None and
               importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def prepare_compile_environment() -> None:
    """Sets COMPILE_ENVIRONMENT for this process; ConfigError if JAX already started without it (too late)."""
    if not cuda_plugin_installed():
        raise ConfigError(CUDA_PLUGIN_MISSING)
    if "jax" in sys.modules:
        _check_started_environment()
        return
    for name, value in COMPILE_ENVIRONMENT.items():
        os.environ[name] = value


def _check_started_environment() -> None:
    import jax

    if jax.config.jax_platforms != COMPILE_ENVIRONMENT["JAX_PLATFORMS"]:
        raise ConfigError("JAX started before the GPU compile environment was set; run with "
                          + " ".join(f"{k}={v}" for k, v in COMPILE_ENVIRONMENT.items()))


def load_target(name: str) -> GpuTarget:
    """A target by name ("h100", "h200": configs/gpu-targets/NAME.pbtxt) or by the path of a description."""
    path = Path(name) if name.endswith(".pbtxt") else TARGETS_DIR / f"{name}.pbtxt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS_DIR.glob("*.pbtxt")))
        raise ConfigError(f"no GPU target description {path} (known targets: {known})")
    text = path.read_text()
    return GpuTarget(name=path.stem, description=text, device_kind=_field(text, "device_description_str", str),
                     memory_bytes=_field(text, "device_memory_size", int),
                     memory_bandwidth=float(_field(text, "memory_bandwidth", int)))


def _field(text: str, name: str, kind):
    found = re.search(rf"\b{name}:\s*\"?([^\"\n]+)\"?", text)
    if found is None:
        raise ConfigError(f"the GPU target description has no {name}")
    return kind(found.group(1).strip())


def target_devices(target: GpuTarget, count: int) -> list:
    """`count` compile-only devices of the target on one host (a topology "1x1xCOUNT")."""
    import jax
    from jax.experimental import topologies

    if not cuda_plugin_installed():
        raise ConfigError(CUDA_PLUGIN_MISSING)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.description,
                                                topology=f"1x1x{count}")
    except (NotImplementedError, jax.errors.JaxRuntimeError) as error:
        raise ConfigError(f"cannot make a {target.name} topology ({error}); run with "
                          + " ".join(f"{k}={v}" for k, v in COMPILE_ENVIRONMENT.items())) from error
    return list(topology.devices)
