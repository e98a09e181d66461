"""The machine the figures come from: devices as JAX and nvidia-smi see them, the CUDA driver, package versions; and
every module the other parts import, imported once here so that a missing wheel shows up first, by name."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
from typing import Any

import jax

from bench_machine import machine_description
from gpu_parts.context import PartContext, PartOutcome, markdown_table

# What the report names versions of: JAX and its CUDA plugins, then what jaxserve and the benchmarks import.
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax",
            "orbax-checkpoint", "numpy", "ml-dtypes", "sentencepiece", "tokenizers", "safetensors", "jinja2", "pyyaml",
            "tqdm", "quart", "hypercorn", "pydantic", "prometheus-client", "llguidance", "jsonschema", "httpx",
            "matplotlib")
# The server (quart, hypercorn, pydantic, prometheus-client), the kernels, the load generator and the plots; jsonschema,
# which structured output imports at its first JSON Schema.
MODULES = ("jaxserve.server.serve", "jaxserve.entrypoints.llm", "kernels_pallas", "kernels", "engine_bench", "startup",
           "serve", "serve_overhead", "speculative", "lora", "lora_kernels", "host_overhead", "structured_output",
           "jsonschema", "matplotlib.pyplot")
NVIDIA_SMI_FIELDS = ("name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory", "power.limit",
                     "pci.bus_id")
NVIDIA_SMI_TIMEOUT_S = 30


def run(context: PartContext) -> PartOutcome:
    if not context.smoke and jax.default_backend() != "gpu":
        raise RuntimeError(f"JAX runs on {jax.default_backend()}, not a GPU: run the CPU check with --smoke")
    for module in MODULES:
        importlib.import_module(module)
    figures = {"machine": machine_description(), "python": sys.version.split()[0],
               "devices": [device_facts(device) for device in jax.local_devices()],
               "packages": {name: installed_version(name) for name in PACKAGES}, "nvidia_smi": nvidia_smi()}
    return PartOutcome(figures, summary(figures))


def device_facts(device: jax.Device) -> dict[str, Any]:
    """Kind, compute capability (GPUs) and the memory JAX's allocator may use."""
    stats = device.memory_stats() or {}
    return {"id": device.id, "kind": device.device_kind, "platform": device.platform,
            "compute_capability": getattr(device, "compute_capability", None),
            "bytes_limit": stats.get("bytes_limit")}


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi() -> dict[str, Any] | None:
    """One row per GPU from nvidia-smi's query mode, and the CUDA version its banner names; None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    cuda = re.search(r"CUDA Version:\s*([0-9.]+)", banner.stdout)
    return {"gpus": parse_gpu_rows(query.stdout), "cuda_version": cuda.group(1) if cuda else None,
            "query_error": query.stderr.strip() or None}


def parse_gpu_rows(csv_text: str) -> list[dict[str, str]]:
    """nvidia-smi's `--format=csv,noheader` rows as dicts of NVIDIA_SMI_FIELDS (units kept: "81559 MiB")."""
    rows = []
    for line in csv_text.splitlines():
        values = [value.strip() for value in line.split(",")]
        if len(values) == len(NVIDIA_SMI_FIELDS):
            rows.append(dict(zip(NVIDIA_SMI_FIELDS, values)))
    return rows


def summary(figures: dict[str, Any]) -> str:
    machine, smi = figures["machine"], figures["nvidia_smi"]
    gpu = smi["gpus"][0] if smi and smi["gpus"] else {}
    rows = [["device", f"{machine['device']} ({machine['jax_backend']}, {len(figures['devices'])} device(s))"],
            ["driver / CUDA", f"{gpu.get('driver_version', '-')} / {(smi or {}).get('cuda_version') or '-'}"],
            ["GPU memory, clocks, power", ", ".join(gpu.get(k, "-") for k in ("memory.total", "clocks.max.sm",
                                                                               "clocks.max.memory", "power.limit"))],
            ["compute capability", figures["devices"][0]["compute_capability"] or "-"],
            ["python / platform", f"{figures['python']} / {machine['platform']} ({machine['cpu_count']} cores)"]]
    rows += [[name, version] for name, version in figures["packages"].items() if version is not None]
    return markdown_table(["what", "value"], rows)
