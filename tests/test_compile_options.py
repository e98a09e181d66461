"""Which XLA options each GPU step program compiles with (runner/compile_options.py): the GPU program audit
(tests/test_gpu_audit.py) shows why, on the programs themselves; here the choice per platform, setting and weights."""

import dataclasses

import pytest

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.model.quantization import IN_PLACE_MAX_ROWS, WEIGHT_FORMATS
from jaxserve.runner.compile_options import IN_PLACE_GEMMS, StepCompilerOptions


@pytest.mark.parametrize("platform, backend, quantized, expected", [
    ("cpu", "auto", False, {}),  # XLA:CPU has no Triton GEMMs to turn off
    ("gpu", "auto", False, IN_PLACE_GEMMS),  # cuBLAS reads each layer's weight slice in place
    ("gpu", "auto", True, {}),  # cuBLAS would widen int8/fp8 slices to bf16 in memory; Triton widens in its GEMM
    ("gpu", "cublas", True, IN_PLACE_GEMMS),
    ("gpu", "triton", False, {}),
    ("gpu", "pallas", True, {}),  # the GEMMs its kernel does not take (steps of many tokens) compile as under auto
    ("gpu", "pallas", False, IN_PLACE_GEMMS),
])
def test_step_programs_compile_their_gemms_where_they_read_weights_in_place(platform, backend, quantized, expected):
    for tokens in (1, 8192):  # no W8A8 format: the same at every step size
        assert StepCompilerOptions(platform, backend, quantized).of(tokens) == expected


@pytest.mark.parametrize("fmt, prefill", [
    (WEIGHT_FORMATS["fp8"], IN_PLACE_GEMMS),  # f8 x f8: cuBLASLt's FP8 GEMM
    (dataclasses.replace(WEIGHT_FORMATS["fp8"], activations=None), {}),  # a weight-only checkpoint: Triton widens
    (dataclasses.replace(WEIGHT_FORMATS["fp8"], block=(128, 128)), {}),  # block scales run W8A16
    (WEIGHT_FORMATS["int8"], {}),
])
def test_w8a8_prefill_steps_compile_to_cublas_and_decode_steps_keep_triton(fmt, prefill):
    options = StepCompilerOptions("gpu", "auto", True, fmt)
    assert options.of(IN_PLACE_MAX_ROWS) == {} and options.of(IN_PLACE_MAX_ROWS + 1) == prefill
    assert StepCompilerOptions("cpu", "auto", True, fmt).of(8192) == {}


def test_an_unknown_gemm_backend_is_refused_by_its_flag():
    with pytest.raises(ConfigError, match="--gemm-backend"):
        EngineConfig(gemm_backend="cutlass")


@pytest.mark.parametrize("settings, platform, expected", [
    (dict(), "gpu", "xla"),
    (dict(gemm_backend="pallas"), "gpu", "pallas"),
    (dict(gemm_backend="pallas", pallas_interpret=True), "cpu", "pallas-interpret"),
])
def test_the_pallas_gemm_backend_gives_the_model_its_kernel(settings, platform, expected):
    assert EngineConfig(**settings).stacked_gemm(platform) == expected


@pytest.mark.parametrize("settings, platform, message", [
    (dict(gemm_backend="pallas"), "cpu", "--pallas-interpret"),  # the compiled kernel needs an NVIDIA GPU
    (dict(gemm_backend="pallas", tensor_parallel_size=2), "gpu", "one device"),
])
def test_the_pallas_gemm_backend_is_refused_where_its_kernel_cannot_run(settings, platform, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings).stacked_gemm(platform)
