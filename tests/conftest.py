"""Shared fixtures: one built-in-model LLM per test session (loading and compiling once keeps the suite fast)."""

import pytest


@pytest.fixture(scope="session")
def tiny_llm():
    """The built-in tiny random model, float32 on CPU, with a short context so edge cases are cheap to reach."""
    from jaxserve import LLM

    return LLM(model=None, dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
               use_tqdm_on_load=False)
