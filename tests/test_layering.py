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


# Each layer and the layers it must never import: imports run server → (entrypoints, openai) → engine → runner →
# model → kernels, and parallel (mesh, sharding rules) sits beside model: checkpoint, runner and engine use it, it uses
# only model. openai (the protocol: request and answer models, bodies, tool calls, prompts) serves both the server and
# entrypoints' run-batch and offline API, and imports neither. gpu_programs (the GPU program audit, reached from the
# command line only) sits beside engine and imports downward; nothing that serves imports it.
_FORBIDDEN = {
    "kernels_pallas": ("jaxserve",),
    "jaxserve/model": ("jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server",
                       "jaxserve.parallel", "jaxserve.gpu_programs", "jaxserve.openai"),
    "jaxserve/parallel": ("jaxserve.checkpoint", "jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints",
                          "jaxserve.server", "jaxserve.gpu_programs", "jaxserve.openai"),
    "jaxserve/checkpoint": ("jaxserve.runner", "jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server",
                            "jaxserve.gpu_programs", "jaxserve.openai"),
    "jaxserve/runner": ("jaxserve.engine", "jaxserve.entrypoints", "jaxserve.server", "jaxserve.gpu_programs",
                        "jaxserve.openai"),
    "jaxserve/engine": ("jaxserve.entrypoints", "jaxserve.server", "jaxserve.gpu_programs", "jaxserve.openai"),
    "jaxserve/openai": ("jaxserve.entrypoints", "jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/entrypoints": ("jaxserve.server", "jaxserve.gpu_programs"),
    "jaxserve/server": ("jaxserve.gpu_programs",),
    "jaxserve/gpu_programs": ("jaxserve.entrypoints", "jaxserve.server", "jaxserve.openai"),
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


def _package_modules(root):
    """Every module of jaxserve and kernels_pallas by dotted name, with the jaxserve modules it imports (anywhere in
    the file: an import inside a function is a cycle all the same, only deferred)."""
    names = {}
    for path in [*(root / "jaxserve").rglob("*.py"), *(root / "kernels_pallas").rglob("*.py")]:
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        imported = set()
        for module in _imported_modules(path):
            while module and module not in names:
                module = module.rpartition(".")[0]  # `from a.b import c`: c may be a name, not a module
            if module and module != name:
                imported.add(module)
        graph[name] = imported
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere (a package's __init__ re-exporting its modules counts as the package): a cycle
    makes modules depend on import order and each other's insides."""
    from pathlib import Path

    graph = _package_modules(Path(__file__).resolve().parent.parent)
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    # A package importing its own submodules (its __init__'s re-exports) is how packages are built, not a cycle.
    graph = {name: {m for m in imported if not (name in packages and m.startswith(name + "."))}
             for name, imported in graph.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
