"""Shared fixtures: one built-in-model LLM per test session (loading and compiling once keeps the suite fast)."""

import gc
import os
import sys

import pytest

# The suite runs on the CPU. The test extras bring JAX's CUDA plugin (for the GPU program audit, which compiles for a
# described GPU); on a machine without a GPU JAX would otherwise try it first and log a failed CUDA start-up in every
# process. Set before anything imports JAX, and inherited by the servers and probes the tests start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def tiny_llm():
    """The built-in tiny random model, float32 on CPU, with a short context so edge cases are cheap to reach."""
    from jaxserve import LLM

    return LLM(model=None, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
               use_tqdm_on_load=False)


@pytest.fixture(autouse=True, scope="module")
def release_each_modules_engines():
    """Collects each module's garbage as it ends. XLA:CPU maps about 230 memory regions per compiled program, and an
    engine compiles dozens: engines a finished module left in reference cycles, kept until Python's collector ran,
    pushed a whole suite process past Linux's vm.max_map_count (65530), and XLA aborted writing its compilation
    cache (seen at 79% of a run from a fresh clone). No module keeps engines past its end, nor the programs its direct
    calls of the Pallas kernels compiled: each kernel entry point is a jit whose cache holds every shape and tuning a
    module tried (the attention kernel tests alone held 71 programs, ~5,700 regions). Engines inline the kernels into
    their own step programs, so clearing these caches recompiles nothing an engine holds."""
    yield
    _clear_kernel_caches()
    gc.collect()


def _clear_kernel_caches() -> None:
    """Empties the jit caches of kernels_pallas' jitted functions (only of its modules already imported)."""
    for name, module in list(sys.modules.items()):
        if name == "kernels_pallas" or name.startswith("kernels_pallas."):
            for value in vars(module).values():
                if callable(getattr(value, "clear_cache", None)) and hasattr(value, "_cache_size"):
                    value.clear_cache()
