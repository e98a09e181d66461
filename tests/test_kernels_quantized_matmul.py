"""The Pallas W8A16 GEMM over layer-stacked weights (kernels_pallas/quantized_matmul.py): interpret-mode equality with
its plain-jnp reference and with the engine's own widen-then-multiply form, only the indexed layer read, refusals by
name, and the CUDA lowering at Llama-3.1-8B shapes. tests/test_gpu_audit.py compiles it in a layer loop for an H100
target and checks that no weight slice is copied."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.quantized_matmul import (QuantizedMatmulTuning, default_tuning, fits, quantized_matmul,
                                             quantized_matmul_reference)
from tests.cuda_lowering import export_for_h100, triton_calls

SMALL = QuantizedMatmulTuning(block_t=16, block_out=16, block_in=32)  # tiles that divide the small shapes below
TOLERANCES = {jnp.float32: dict(atol=1e-4, rtol=1e-4), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# Llama-3.1-8B's projections as (in, out): q/o, k/v, gate/up, down.
LLAMA_8B_PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "gate_proj": (4096, 14336),
                        "down_proj": (14336, 4096)}


def stacked(seed: int, layers: int, tokens: int, width: int, out: int, weight_dtype, dtype):
    """x, a layer-stacked quantized weight q[L, out, in] and its per-channel scales f32[L, out]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, width)), dtype)
    if weight_dtype == jnp.int8:
        q = jnp.asarray(rng.integers(-127, 128, size=(layers, out, width)), jnp.int8)
    else:
        q = jnp.asarray(rng.uniform(-448, 448, size=(layers, out, width)), jnp.float32).astype(weight_dtype)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, size=(layers, out)), jnp.float32)
    return x, q, scale


@pytest.mark.parametrize("weight_dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("tokens", "layer"), [(1, 0), (5, 2), (16, 1), (33, 2)])
def test_the_kernel_multiplies_by_the_indexed_layer_as_the_reference_does(weight_dtype, dtype, tokens, layer):
    x, q, scale = stacked(tokens + layer, 3, tokens, 64, 48, weight_dtype, dtype)
    got = quantized_matmul(x, q, scale, jnp.int32(layer), tuning=SMALL, interpret=True)
    assert got.dtype == dtype and got.shape == (tokens, 48)
    want = quantized_matmul_reference(x, q, scale, jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[dtype])
    # The engine's own weight-only form: the layer's weight widened, multiplied, then scaled per output channel.
    engine = (x.astype(jnp.float32) @ q[layer].astype(jnp.float32).T) * scale[layer]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(engine, np.float32), **TOLERANCES[dtype])


def test_only_the_indexed_layer_is_read():
    x, q, scale = stacked(7, 3, 4, 64, 32, jnp.float8_e4m3fn, jnp.float32)
    poisoned_q = q.at[jnp.array([0, 2])].set(jnp.nan)  # float8_e4m3fn holds NaN; int8 has none
    poisoned_scale = scale.at[jnp.array([0, 2])].set(jnp.nan)
    got = quantized_matmul(x, poisoned_q, poisoned_scale, jnp.int32(1), tuning=SMALL, interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(quantized_matmul_reference(x, q, scale, jnp.int32(1))),
                               **TOLERANCES[jnp.float32])


def test_one_compiled_kernel_serves_every_layer_of_a_scan():
    """The layer index is traced: a scan over layers runs one program, as the engine's decoder does."""
    x, q, scale = stacked(3, 4, 2, 32, 32, jnp.int8, jnp.float32)

    def through_layers(h):
        def layer(carry, index):
            return carry, quantized_matmul(h, q, scale, index, tuning=SMALL, interpret=True)
        return jax.lax.scan(layer, 0, jnp.arange(4))[1]

    got = jax.jit(through_layers)(x)  # f32[4, tokens, out]
    for layer in range(4):
        np.testing.assert_allclose(np.asarray(got[layer]),
                                   np.asarray(quantized_matmul_reference(x, q, scale, jnp.int32(layer))),
                                   **TOLERANCES[jnp.float32])


@pytest.mark.parametrize(("change", "message"), [
    (dict(width=40), "multiples of block_in"),
    (dict(out=40), "multiples of block_in"),
    (dict(weight_dtype=jnp.bfloat16), "int8 or float8_e4m3fn"),
    (dict(scale_shape=(2, 32)), "do not fit x"),
])
def test_inputs_the_kernel_cannot_take_are_refused_by_name(change, message):
    width, out = change.get("width", 32), change.get("out", 32)
    x, q, scale = stacked(0, 3, 2, width, out, jnp.int8, jnp.float32)
    if "weight_dtype" in change:
        q = q.astype(change["weight_dtype"])
    if "scale_shape" in change:
        scale = jnp.ones(change["scale_shape"], jnp.float32)
    with pytest.raises(ValueError, match=message):
        quantized_matmul(x, q, scale, jnp.int32(0), tuning=SMALL, interpret=True)


def test_the_default_tuning_fits_llamas_projections_and_refuses_what_it_cannot_tile():
    for width, out in LLAMA_8B_PROJECTIONS.values():
        for tokens in (1, 8, 64, 256):
            tuning = default_tuning(tokens, width, out)
            assert width % tuning.block_in == 0 and out % tuning.block_out == 0
            assert tuning.block_t <= 64 and (tokens > 64 or tuning.block_t >= min(tokens, 64))
    assert not fits(4096, 1000) and not fits(1000, 4096) and fits(14336, 4096)


@pytest.mark.parametrize("projection", sorted(LLAMA_8B_PROJECTIONS))
def test_the_kernel_lowers_to_triton_for_an_h100(projection):
    width, out = LLAMA_8B_PROJECTIONS[projection]
    avals = (jax.ShapeDtypeStruct((8, width), jnp.bfloat16), jax.ShapeDtypeStruct((32, out, width), jnp.int8),
             jax.ShapeDtypeStruct((32, out), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    assert triton_calls(export_for_h100(quantized_matmul, *avals)) == 1
