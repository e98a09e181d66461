"""Prints `name==version`, one a line: the wheels a GPU host with JAX lacks to run jaxserve and its benchmarks.

What is needed: jaxserve's dependencies and the benchmarks' (httpx for the load generator, matplotlib for the plots),
with everything they require. What such a host already has: jax, jaxlib, flax, orbax-checkpoint, sentencepiece and
numpy, with everything they require (they run there, so their requirements are met there). The list is the first
set minus the second, at the versions installed in the environment that runs this script: the ones the test suite
passed with, plus CARRIED_ANYWAY. jaxserve itself is left out (it runs from the source tree).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

from packaging.requirements import Requirement

NEEDED = ("jaxserve", "httpx", "matplotlib")
ON_A_GPU_HOST = ("jax", "jaxlib", "flax", "orbax-checkpoint", "sentencepiece", "numpy")
# Declared but never imported: tokenizers requires huggingface-hub for downloads from the Hub, which jaxserve
# never does (its Python package does not import it), and the hub client would bring a dozen packages of its own.
NEVER_IMPORTED = ("huggingface-hub",)
FROM_SOURCE = ("jaxserve",)
# On the host already, but needed newer than the host's own packages ask for: pydantic and anyio require
# typing-extensions >= 4.16. Pure Python and backward compatible, so ours can shadow the host's.
CARRIED_ANYWAY = ("typing-extensions",)


def canonical(name: str) -> str:
    """PEP 503's normalized name: `PyYAML`, `pyyaml` and `py_yaml` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(roots: tuple[str, ...], pruned: tuple[str, ...] = ()) -> dict[str, str]:
    """Every installed distribution the roots require, directly or not (extras left out), with its version."""
    versions: dict[str, str] = {}
    pending = [canonical(name) for name in roots]
    while pending:
        name = pending.pop()
        if name in versions or name in pruned:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"gpu_wheel_list: {name} is not installed here; run `make test` once to install the test extras")
        versions[name] = distribution.version
        for line in distribution.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonical(requirement.name))
    return versions


def missing_on_gpu_host() -> dict[str, str]:
    present = requirement_closure(ON_A_GPU_HOST)
    needed = requirement_closure(NEEDED, pruned=NEVER_IMPORTED)
    return {name: version for name, version in sorted(needed.items())
            if (name not in present or name in CARRIED_ANYWAY) and name not in FROM_SOURCE}


if __name__ == "__main__":
    print("\n".join(f"{name}=={version}" for name, version in missing_on_gpu_host().items()))
