"""Checkpoints written by HF transformers load into jaxserve and give HF's float32 logits."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.checkpoint import load_model  # noqa: E402
from jaxserve.checkpoint.param_tree import checkpoint_tensors, flat_arrays  # noqa: E402
from tests.hf_models import hf_logits, jaxserve_logits, random_tokens, save_tiny_hf_llama  # noqa: E402

pytestmark = pytest.mark.parity

SEQUENCE_LENGTH = 40
TOLERANCE = 1e-4  # max-abs on logits of magnitude ~5; float32 reduction-order noise is ~1e-5

CASES = {
    "llama2": dict(style="llama2"),
    "llama31": dict(style="llama31"),
    "tied": dict(style="tied"),
    "llama31-sharded": dict(style="llama31", sharded=True),
    "llama31-top-level-rope-keys": dict(style="llama31", rope_keys="top_level"),
    "llama2-top-level-rope-keys": dict(style="llama2", rope_keys="top_level"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_logits_match_hf(tmp_path, case):
    hf_model = save_tiny_hf_llama(tmp_path, **case)
    tokens = random_tokens(hf_model.config.vocab_size, SEQUENCE_LENGTH)
    loaded = load_model(tmp_path, dtype="float32", progress=False)
    expected = hf_logits(hf_model, tokens)
    np.testing.assert_allclose(jaxserve_logits(loaded, tokens), expected, rtol=0, atol=TOLERANCE)


def test_bfloat16_checkpoint_from_transformers_loads_bit_exact(tmp_path):
    import torch

    hf_model = save_tiny_hf_llama(tmp_path, "tied", dtype="bfloat16")
    loaded = load_model(tmp_path, "bfloat16", progress=False)
    assert loaded.dtype == jnp.bfloat16
    hf_weights = hf_model.state_dict()
    for name, array in checkpoint_tensors(flat_arrays(loaded.params)).items():
        expected = hf_weights[name].to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(np.asarray(array).astype(np.float32), expected, err_msg=name)
