"""The Pallas W4A16 GEMM over layer-stacked packed 4-bit weights (kernels_pallas/int4_matmul.py): interpret-mode
equality with its plain-jnp reference and with a numpy product on the unpacked values (group and channel scales,
with and without zero points, a partial last block), only the indexed layer read, refusals by name, and the CUDA
lowering at Llama-3.1-8B shapes. tests/test_gpu_audit.py compiles it in a layer loop for an H100 target and checks
that nothing is copied or widened in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.quantization import pack_int4, packed_width
from kernels_pallas.int4_matmul import int4_fits, int4_matmul, int4_matmul_reference
from kernels_pallas.quantized_matmul import QuantizedMatmulTuning
from tests.cuda_lowering import export_for_h100, triton_calls

SMALL = QuantizedMatmulTuning(block_t=16, block_out=16, block_in=64)
LAYERS, OUT = 3, 48


def stacked(seed: int, width: int, group_size: int | None, zero_points: bool):
    """(values i8[L, out, in], packed q, scales, zero points or None) of a random layer-stacked 4-bit weight."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-8, 8, size=(LAYERS, OUT, width)).astype(np.int8)
    groups = (OUT,) if group_size is None else (OUT, -(-width // group_size))
    scale = rng.uniform(0.01, 0.1, size=(LAYERS, *groups)).astype(np.float32)
    zero = rng.integers(-8, 8, size=scale.shape).astype(np.int8) if zero_points else None
    return values, jnp.asarray(pack_int4(values)), jnp.asarray(scale), None if zero is None else jnp.asarray(zero)


def numpy_product(x: np.ndarray, values: np.ndarray, scale: np.ndarray, zero, group_size: int | None) -> np.ndarray:
    width = values.shape[-1]
    size = width if group_size is None else group_size
    per_feature = (lambda a: np.repeat(np.asarray(a, np.float64).reshape(OUT, -1), size, 1)[:, :width])
    weight = (values - (0 if zero is None else per_feature(zero))) * per_feature(scale)
    return np.asarray(x, np.float64) @ weight.T


@pytest.mark.parametrize(("group_size", "zero_points"), [(64, True), (128, False), (None, True), (None, False)])
@pytest.mark.parametrize(("tokens", "layer", "width"), [(1, 0, 128), (5, 2, 200), (33, 1, 256)])
def test_the_kernel_multiplies_by_the_indexed_layer_as_the_reference_and_numpy_do(group_size, zero_points, tokens,
                                                                                   layer, width):
    values, q, scale, zero = stacked(tokens + layer, width, group_size, zero_points)
    assert q.shape == (LAYERS, OUT, packed_width(width))
    x = jnp.asarray(np.random.default_rng(layer).normal(size=(tokens, width)), jnp.float32)
    got = int4_matmul(x, q, scale, zero, jnp.int32(layer), group_size=group_size, tuning=SMALL, interpret=True)
    assert got.shape == (tokens, OUT) and got.dtype == jnp.float32
    reference = int4_matmul_reference(x, q, scale, zero, jnp.int32(layer), group_size)
    np.testing.assert_allclose(got, reference, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got, numpy_product(x, values[layer], scale[layer], None if zero is None else
                                                  zero[layer], group_size), atol=2e-5, rtol=1e-5)


def test_only_the_indexed_layer_is_read():
    values, q, scale, zero = stacked(0, 128, 64, True)
    x = jnp.ones((2, 128), jnp.float32)
    poisoned = q.at[0].set(0xFF).at[2].set(0x00)  # other layers' bytes changed
    nan_scales = scale.at[0].set(jnp.nan).at[2].set(jnp.nan)
    kept = int4_matmul(x, q, scale, zero, jnp.int32(1), group_size=64, tuning=SMALL, interpret=True)
    changed = int4_matmul(x, poisoned, nan_scales, zero, jnp.int32(1), group_size=64, tuning=SMALL, interpret=True)
    np.testing.assert_array_equal(kept, changed)


@pytest.mark.parametrize(("out", "group_size", "fits"), [(48, 128, True), (48, None, True), (40, 128, False),
                                                         (48, 32, False)])
def test_the_kernel_takes_multiples_of_16_rows_and_groups_of_whole_packed_blocks(out, group_size, fits):
    assert int4_fits(out, group_size) == fits
    if not fits:
        q = jnp.zeros((1, out, 64), jnp.uint8)
        with pytest.raises(ValueError, match="group_size None or a multiple of 64"):
            int4_matmul(jnp.zeros((1, 128)), q, jnp.ones((1, out, 4)), None, jnp.int32(0), group_size=group_size)


@pytest.mark.parametrize("projection", [(4096, 4096), (4096, 14336), (14336, 4096)], ids=["q", "gate", "down"])
def test_the_cuda_lowering_at_llama_8b_shapes_is_one_triton_kernel(projection):
    width, out = projection
    avals = (jax.ShapeDtypeStruct((8, width), jnp.bfloat16),
             jax.ShapeDtypeStruct((32, out, packed_width(width)), jnp.uint8),
             jax.ShapeDtypeStruct((32, out, width // 128), jnp.float32),
             jax.ShapeDtypeStruct((32, out, width // 128), jnp.int8), jax.ShapeDtypeStruct((), jnp.int32))
    exported = export_for_h100(lambda x, q, s, z, layer: int4_matmul(x, q, s, z, layer, group_size=128), *avals)
    assert triton_calls(exported) == 1
