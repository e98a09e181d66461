"""Host-only layers stay free of JAX, so scheduling and tokenization never touch the device."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["jaxserve.engine.scheduler", "jaxserve.engine.page_pool",
                                    "jaxserve.engine.stop_strings", "jaxserve.tokenizer", "jaxserve.settings"])
def test_module_imports_without_jax(module):
    code = f"import sys, {module}; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imported JAX"
