"""The Pallas LoRA kernels (kernels_pallas/lora_bgmv.py): interpret-mode equality with the gather reference and with
the engine's one-hot form (model/lora.py), slot 0 read as no adapter, and the CUDA lowering at Llama-3.1-8B shapes."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.lora import lora_delta
from kernels_pallas.lora_bgmv import BgmvTuning, lora_bgmv, lora_bgmv_reference
from tests.cuda_lowering import export_for_h100, triton_calls

SMALL = BgmvTuning(in_block=16, out_block=32)  # tiles that divide the small shapes below
TOLERANCES = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# Llama-3.1-8B's projections as (in, out): q/o, k/v, gate/up, down.
LLAMA_8B_PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "gate_proj": (4096, 14336),
                        "down_proj": (14336, 4096)}


def adapters(seed: int, tokens: int, width: int, out: int, slots: int, rank: int, dtype):
    """x, a, b with slot 0 zero (as the engine keeps it), and slots drawn over [0, slots)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, width)), dtype)
    a = jnp.asarray(rng.uniform(-0.3, 0.3, size=(slots, rank, width)), dtype).at[0].set(0)
    b = jnp.asarray(rng.normal(0, 0.5, size=(slots, out, rank)), dtype).at[0].set(0)
    token_slots = jnp.asarray(rng.integers(0, slots, size=tokens), jnp.int32)
    return x, a, b, token_slots


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("tokens", "width", "out", "slots", "rank"), [
    (1, 32, 32, 2, 1), (7, 64, 96, 3, 8), (16, 48, 64, 5, 16), (5, 16, 32, 4, 4)])
def test_the_kernels_give_each_tokens_own_adapter_delta(dtype, tokens, width, out, slots, rank):
    x, a, b, token_slots = adapters(tokens * width + rank, tokens, width, out, slots, rank, dtype)
    got = lora_bgmv(x, a, b, token_slots, tuning=SMALL, interpret=True)
    assert got.dtype == dtype and got.shape == (tokens, out)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(lora_bgmv_reference(x, a, b, token_slots),
                                                                       np.float32), **TOLERANCES[dtype])
    engine = jax.jit(lora_delta)(x, a, b, token_slots)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(engine, np.float32), **TOLERANCES[dtype])


def test_slot_0_is_no_adapter_whatever_its_weights_hold():
    x, a, b, _ = adapters(3, 4, 32, 32, 3, 4, jnp.float32)
    poisoned_a, poisoned_b = a.at[0].set(jnp.nan), b.at[0].set(jnp.nan)
    token_slots = jnp.asarray([0, 1, 0, 2], jnp.int32)
    got = np.asarray(lora_bgmv(x, poisoned_a, poisoned_b, token_slots, tuning=SMALL, interpret=True))
    assert not got[[0, 2]].any()
    np.testing.assert_allclose(got[[1, 3]], np.asarray(lora_bgmv_reference(x, a, b, token_slots))[[1, 3]],
                               **TOLERANCES[jnp.float32])


@pytest.mark.parametrize(("shapes", "message"), [
    (dict(rank=6), "power of two"),
    (dict(width=40), "multiples of in_block"),
    (dict(out=48), "multiples of in_block"),
])
def test_shapes_the_kernels_cannot_take_are_refused_by_name(shapes, message):
    args = dict(seed=0, tokens=2, width=32, out=32, slots=2, rank=4, dtype=jnp.float32) | shapes
    with pytest.raises(ValueError, match=message):
        lora_bgmv(*adapters(**args), tuning=SMALL, interpret=True)


@pytest.mark.parametrize("projection", LLAMA_8B_PROJECTIONS)
def test_the_kernels_lower_to_triton_for_an_h100(projection):
    width, out = LLAMA_8B_PROJECTIONS[projection]
    avals = (jax.ShapeDtypeStruct((256, width), jnp.bfloat16), jax.ShapeDtypeStruct((5, 16, width), jnp.bfloat16),
             jax.ShapeDtypeStruct((5, out, 16), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.int32))
    assert triton_calls(export_for_h100(lora_bgmv, *avals)) == 2
