"""Runs the real Pallas-to-Triton CUDA lowering of a kernel on a host without a GPU, under an abstract H100."""

import jax

TRITON_TARGET = "__gpu$xla.gpu.triton"
CUDNN_ATTENTION_TARGET = "__cudnn$fmhaSoftmax"  # cuDNN's fused flash attention (forward, no bias, no dropout)
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def export_for_h100(function, *avals) -> jax.export.Exported:
    """`jax.export` of `function` for CUDA; fails if any part of the Triton lowering fails."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H100)):
        return jax.export.export(
            jax.jit(function), platforms=["cuda"],
            # Triton kernels are serialized into the custom call, which has no cross-version compatibility promise;
            # nor has cuDNN's attention call.
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)
                             for target in (TRITON_TARGET, CUDNN_ATTENTION_TARGET)],
        )(*avals)


def triton_calls(exported: jax.export.Exported, target: str = TRITON_TARGET) -> int:
    """How many Triton kernels (or custom calls of another `target`) the exported CUDA module launches."""
    return exported.mlir_module().count(f"custom_call @{target}")
