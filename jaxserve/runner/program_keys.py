"""The keys compiled step programs are stored under (runner/program_store.py), taken from what each program is
lowered with rather than from a list of settings.

A program's key hashes three things:
- its runner's `StoreScope`, which all its programs share: the store's format, the versions of jax, jaxlib and (for
  GPUs) the CUDA plugin, XLA_FLAGS and the JAX settings that change lowering, the platform, kind and ids of the
  mesh's devices (and on the CPU the host CPU's model and features, which XLA:CPU compiles for), its axes, the
  process count, a hash of the sources programs are traced from (SOURCE_DIRS), and the
  model's graph definition (every layer and static attribute, the model's config among them);
- its `ProgramCall.signature`: the jitted function's name, and every argument it is lowered with as an abstract
  value (the tree structure, each leaf's dtype, shape and sharding: weights, KV pool, LoRA slots, packed inputs,
  masks), and its static arguments (the transfer buffer's layout, the logprob count, the row count);
- the XLA options it compiles with.

So the engine settings that shape programs reach the key through the programs' inputs, not by name: the step limits
fix the buckets and the transfer layouts, dtype and quantization the weights' dtypes and tree, kv_cache_dtype the
pool's dtype, block_size and the pool's size its shape, the attention backend the pool's static tree data, LoRA its
slots, speculation the verifying buckets, max_logprobs a static argument, gemm_backend the XLA options; a setting
that changes none of them (seed, scheduling) leaves the key alone, and a new one that does changes it unlisted.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

STORE_FORMAT = 1  # raised whenever the entry format or what a key covers changes
_ROOT = Path(__file__).resolve().parents[2]
# The sources the step programs are traced from: any change in them may change a program.
SOURCE_DIRS = ("jaxserve/runner", "jaxserve/model", "jaxserve/parallel", "kernels_pallas")
# JAX settings that change what a program lowers to, read from jax.config.
JAX_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_dtype_promotion",
                "jax_default_prng_impl", "jax_threefry_partitionable", "jax_use_shardy_partitioner")
# Environment variables XLA reads its flags from.
XLA_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# Distributions whose versions a program depends on: JAX's own, and on a GPU the CUDA plugin that compiled it.
JAX_DISTRIBUTIONS = ("jax", "jaxlib")
GPU_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
# What a description holds when it names an object by its address: not the same text in the next process.
_UNSTABLE_TEXT = " at 0x"


class UnstableKeyError(ValueError):
    """A program's inputs describe themselves differently in every process: it cannot be found again."""


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One program as it is lowered: its jitted function and the abstract and static arguments it is lowered with."""

    function: Any  # the jax.jit-wrapped function
    name: str  # which function it is, e.g. "run_packed_step"
    args: tuple  # positional arguments: pytrees of jax.ShapeDtypeStruct (None where absent)
    static: dict  # its static keyword arguments (the transfer layout, logprob and row counts)
    # The mesh to lower under when its devices are described, not present (a GPU target compiled on any machine):
    # Pallas asks it which GPU its kernels lower for. None: the devices at hand say. Not part of the key.
    abstract_mesh: Any = None

    def lower(self) -> jax.stages.Lowered:
        if self.abstract_mesh is None:
            return self.function.lower(*self.args, **self.static)
        with jax.sharding.use_abstract_mesh(self.abstract_mesh):
            return self.function.lower(*self.args, **self.static)

    def signature(self) -> str:
        """Every input of the program as text: the same text in every process, whatever the order of start-up."""
        leaves, treedef = jax.tree.flatten(self.args)
        lines = [self.name, str(treedef), *map(_abstract_text, leaves),
                 *(f"{name}={value!r}" for name, value in sorted(self.static.items()))]
        return _stable("\n".join(lines), f"the inputs of {self.name}")

    def accepts(self, compiled: jax.stages.Compiled) -> bool:
        """The compiled program takes exactly these arguments (tree, dtypes, shapes, shardings): a last check that
        a program read back is the one asked for."""
        leaves = jax.tree.leaves(self.args)
        infos = jax.tree.leaves(compiled.args_info)
        if compiled.in_tree != jax.tree.structure((self.args, {})) or len(infos) != len(leaves):
            return False
        shardings = jax.tree.leaves(compiled.input_shardings)
        return all(info.shape == leaf.shape and info.dtype == leaf.dtype
                   and sharding.is_equivalent_to(leaf.sharding, len(leaf.shape))
                   for info, leaf, sharding in zip(infos, leaves, shardings))


@dataclasses.dataclass(frozen=True)
class StoreScope:
    """What every program of one runner shares, as a JSON-ready description; its hash leads each program's key."""

    description: dict  # {"format", "versions", "environment", "jax_settings", "devices", "sources", "model", ...}

    @property
    def key(self) -> str:
        return _digest(json.dumps(self.description, sort_keys=True))[:24]

    @classmethod
    def of(cls, model_config: Any, graphdef: Any, mesh: Mesh) -> StoreScope:
        """The scope of a runner of the model (its config and nnx graph definition) over `mesh`."""
        devices = list(mesh.devices.flat)
        device_platform = devices[0].platform
        distributions = JAX_DISTRIBUTIONS + (GPU_DISTRIBUTIONS if device_platform == "gpu" else ())
        return cls({
            "format": STORE_FORMAT,
            "versions": {name: _version(name) for name in distributions},
            "environment": {name: os.environ.get(name, "") for name in XLA_ENVIRONMENT},
            "jax_settings": {name: repr(getattr(jax.config, name, None)) for name in JAX_SETTINGS},
            "devices": {"platform": device_platform, "kinds": sorted({d.device_kind for d in devices}),
                        "ids": [d.id for d in devices], "mesh_axes": list(mesh.axis_names),
                        "mesh_shape": list(mesh.devices.shape), "processes": len({d.process_index for d in devices}),
                        "host_cpu": host_cpu() if device_platform == "cpu" else ""},
            "sources": source_hash(),
            "model": _digest(_stable(repr(graphdef), "the model's graph definition")),
            "model_config": repr(model_config),  # in the graph definition too; here for whoever reads scope.json
        })


def program_key(scope: StoreScope, signature: str, compiler_options: dict) -> str:
    """The key of one program: its scope, its inputs and its XLA options."""
    options = json.dumps(compiler_options, sort_keys=True, default=repr)
    return _digest("\n".join((scope.key, signature, options)))[:32]


@functools.cache
def source_hash() -> str:
    """A hash of every Python source under SOURCE_DIRS, by path and content."""
    digest = hashlib.sha256()
    for directory in SOURCE_DIRS:
        for path in sorted((_ROOT / directory).rglob("*.py")):
            digest.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


@functools.cache
def host_cpu() -> str:
    """The host CPU's model and feature flags (Linux: /proc/cpuinfo), hashed; else the machine's architecture.
    XLA:CPU compiles for the features of the CPU it runs on: a program built on another CPU may not run here."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return _digest("\n".join(sorted(set(wanted))))[:16] if wanted else platform.machine()


def scope_differences(ours: dict, theirs: dict) -> list[str]:
    """The names of the top-level parts in which two scope descriptions differ ("sources", "versions", ...)."""
    return [name for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)]


def _abstract_text(leaf: Any) -> str:
    if not hasattr(leaf, "shape"):
        return repr(leaf)
    return f"{leaf.dtype}{list(leaf.shape)} {getattr(leaf, 'sharding', None)} weak={getattr(leaf, 'weak_type', False)}"


def _stable(text: str, what: str) -> str:
    if _UNSTABLE_TEXT in text:
        raise UnstableKeyError(f"{what} name an object by its address, which differs in every process")
    return text


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
