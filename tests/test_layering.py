"""Host-only layers stay free of JAX, so scheduling and tokenization never touch the device."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["jaxserve.engine.scheduler", "jaxserve.engine.page_pool",
                                    "jaxserve.engine.stop_strings", "jaxserve.tokenizer", "jaxserve.config",
                                    "jaxserve.schedule"])
def test_module_imports_without_jax(module):
    code = f"import sys, {module}; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imported JAX"


# Each layer and the layers it must never import: imports run server → engine → runner → model → kernels, and
# parallel (mesh, sharding rules) sits beside model: checkpoint, runner and engine use it, it uses only model.
# gpu_programs (the GPU program audit, reached from the command line only) sits beside engine and imports downward;
# nothing that serves imports it.
_FORBIDDEN = {
    "kernels_pallas": ("jaxserve",),
    "jaxserve/model": ("jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server",
                       "jaxserve.parallel", "jaxserve.gpu_programs"),
    "jaxserve/parallel": ("jaxserve.checkpoint", "jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints",
                          "jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/checkpoint": ("jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server",
                            "jaxserve.gpu_programs"),
    "jaxserve/runner": ("jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/engine": ("jaxserve.entrypoints", "jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/entrypoints": ("jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/server": ("jaxserve.gpu_programs",),
    "jaxserve/gpu_programs": ("jaxserve.entrypoints", "jaxserve.server"),
}


def _imported_modules(path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from jaxserve import reference` imports the submodule jaxserve.reference.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("layer", sorted(_FORBIDDEN))
def test_imports_run_downward_only(layer):
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}"
    wrong = [(f.relative_to(root), m) for f in files for m in _imported_modules(f)
             if any(m == up or m.startswith(up + ".") for up in _FORBIDDEN[layer])]
    assert not wrong, f"upward imports: {wrong}"


def test_the_product_never_imports_the_reference_oracles():
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "jaxserve"
    files = sorted(f for f in package.rglob("*.py") if "reference" not in f.relative_to(package).parts)
    wrong = [(f.relative_to(package), m) for f in files for m in _imported_modules(f)
             if m == "jaxserve.reference" or m.startswith("jaxserve.reference.")]
    assert files and not wrong, f"product modules importing jaxserve.reference: {wrong}"
