"""Shared fixtures: one built-in-model LLM per test session (loading and compiling once keeps the suite fast)."""

import os

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
