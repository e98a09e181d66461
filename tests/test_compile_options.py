"""Which XLA options each GPU step program compiles with (runner/compile_options.py): the GPU program audit
(tests/test_gpu_audit.py) shows why, on the programs themselves; here the choice per platform, setting and weights."""

import pytest

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.runner.compile_options import IN_PLACE_GEMMS, step_compiler_options


@pytest.mark.parametrize("platform, backend, quantized, expected", [
    ("cpu", "auto", False, {}),  # XLA:CPU has no Triton GEMMs to turn off
    ("gpu", "auto", False, IN_PLACE_GEMMS),  # cuBLAS reads each layer's weight slice in place
    ("gpu", "auto", True, {}),  # cuBLAS would widen int8/fp8 slices to bf16 in memory; Triton widens in its GEMM
    ("gpu", "cublas", True, IN_PLACE_GEMMS),
    ("gpu", "triton", False, {}),
])
def test_step_programs_compile_their_gemms_where_they_read_weights_in_place(platform, backend, quantized, expected):
    assert step_compiler_options(platform, backend, quantized) == expected


def test_an_unknown_gemm_backend_is_refused_by_its_flag():
    with pytest.raises(ConfigError, match="--gemm-backend"):
        EngineConfig(gemm_backend="cutlass")
