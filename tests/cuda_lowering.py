"""Runs the real Pallas-to-Triton CUDA lowering of a kernel on a host without a GPU, under an abstract H100."""

import jax

TRITON_TARGET = "__gpu$xla.gpu.triton"
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def export_for_h100(function, *avals) -> jax.export.Exported:
    """`jax.export` of `function` for CUDA; fails if any part of the Triton lowering fails."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        return jax.export.export(
            jax.jit(function), platforms=["cuda"],
            # Triton kernels are serialized into the custom call, which has no cross-version compatibility promise.
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)],
        )(*avals)


def triton_calls(exported: jax.export.Exported) -> int:
    """How many Triton kernels the exported CUDA module launches."""
    return exported.mlir_module().count(f"custom_call @{TRITON_TARGET}")
