"""Compiles the GPU programs tests/test_gpu_audit.py checks, for an H100 target, and pickles their audits.

Run by the tests in a subprocess: JAX must start with its CUDA plugin registered beside the CPU backend
(JAX_PLATFORMS=cpu, set before JAX starts), which the rest of the suite does not want. Only the programs the guards
need are compiled (the full grid of a preset takes minutes). Usage: python -m tests.gpu_audit_probe OUT.pickle
(from the repository root). The constants below are imported by the tests and import no JAX.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = 2  # compiles at once: the suite's machines have two cores


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """One engine configuration and the programs of it the guards check."""

    name: str  # test id prefix
    preset: str  # configs/ file
    overrides: dict  # settings beside the preset (the command line's flags)
    programs: tuple[str, ...]  # program names (gpu_programs.build.program_name)
    target: str = "h100"  # the GPU compiled for (configs/gpu-targets)
    # config.json's quantization_config of a pre-quantized checkpoint of the model (its format decides the weights')
    quantization_config: dict | None = None


# The 8B H100 preset: decode at the row counts where XLA's choices change (GEMV, merged q/k/v, GEMM), mixed steps
# small and full, a step with its sampler in one program, and the samplers.
LLAMA_8B = EngineSetup("8b-h100", "configs/llama-3.1-8b-h100.yaml", {},
                       ("decode S=1", "decode S=2", "decode S=8", "decode S=64", "mixed T=512 S=64",
                        "mixed T=8192 S=64", "decode S=1 +penalties", "sampler S=1", "sampler S=64",
                        "sampler S=64 untruncated"))
LLAMA_8B_INT8 = EngineSetup("8b-h100-int8", "configs/llama-3.1-8b-h100.yaml", {"quantization": "int8"},
                            ("decode S=1", "decode S=64", "mixed T=2048 S=64"))
LLAMA_8B_FP8 = EngineSetup("8b-h100-fp8", "configs/llama-3.1-8b-h100.yaml", {"quantization": "fp8"},
                           ("decode S=1", "decode S=64", "mixed T=2048 S=64"))
# The same with --gemm-backend pallas: decode steps read the int8/fp8 stacks in place (kernels_pallas/quantized_matmul.py).
LLAMA_8B_INT8_PALLAS = EngineSetup("8b-h100-int8-pallas", "configs/llama-3.1-8b-h100.yaml",
                                   {"quantization": "int8", "gemm_backend": "pallas"}, ("decode S=1", "decode S=64"))
LLAMA_8B_FP8_PALLAS = EngineSetup("8b-h100-fp8-pallas", "configs/llama-3.1-8b-h100.yaml",
                                  {"quantization": "fp8", "gemm_backend": "pallas"}, ("decode S=1",))
# W8A8: the same fp8 prefill step compiled for an H200.
LLAMA_8B_FP8_H200 = EngineSetup("8b-h200-fp8", "configs/llama-3.1-8b-h100.yaml", {"quantization": "fp8"},
                                ("mixed T=2048 S=64",), target="h200")
# A 4-bit GPTQ checkpoint (group 128, symmetric): every step through the Pallas W4A16 kernel.
LLAMA_8B_INT4 = EngineSetup("8b-h100-int4", "configs/llama-3.1-8b-h100.yaml", {},
                            ("decode S=1", "decode S=64", "mixed T=2048 S=64"),
                            quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                                 "desc_act": False})
LLAMA_8B_INT4_H200 = EngineSetup("8b-h200-int4", "configs/llama-3.1-8b-h100.yaml", {}, ("decode S=1",),
                                 target="h200", quantization_config=LLAMA_8B_INT4.quantization_config)
LLAMA_70B = EngineSetup("70b-8xh100", "configs/llama-3.1-70b-8xh100.yaml", {},
                        ("decode S=1", "decode S=64", "mixed T=8192 S=64"))
ENGINE_SETUPS = (LLAMA_8B, LLAMA_8B_INT8, LLAMA_8B_FP8, LLAMA_8B_INT8_PALLAS, LLAMA_8B_FP8_PALLAS, LLAMA_8B_FP8_H200,
                 LLAMA_8B_INT4, LLAMA_8B_INT4_H200, LLAMA_70B)


def engine_key(setup: EngineSetup, program: str) -> str:
    return f"{setup.name}: {program}"


def example_key(name: str) -> str:
    return f"example: {name}"


def main(out: Path) -> None:
    from jaxserve.gpu_programs.target import prepare_compile_environment

    prepare_compile_environment()
    started = time.perf_counter()
    results = {"audits": {}, "compile_seconds": {}}
    for setup in ENGINE_SETUPS:
        _audit_engine(setup, results)
    _audit_examples(results)
    results["wall_seconds"] = time.perf_counter() - started
    out.write_bytes(pickle.dumps(results))


def _audit_engine(setup: EngineSetup, results: dict) -> None:
    from jaxserve.config import load_config
    from jaxserve.gpu_programs.audit import audit_program
    from jaxserve.gpu_programs.build import build_engine, compile_programs, engine_programs, program_name
    from jaxserve.gpu_programs.model_shapes import model_shape
    from jaxserve.gpu_programs.target import load_target

    preset = REPO / setup.preset
    name, hf_config = model_shape(None, preset)
    if setup.quantization_config is not None:
        hf_config = {**hf_config, "quantization_config": setup.quantization_config}
    engine = build_engine(name, hf_config, load_config(preset, setup.overrides), load_target(setup.target))
    programs = [p for p in engine_programs(engine) if program_name(p) in setup.programs]
    missing = set(setup.programs) - {program_name(p) for p in programs}
    if missing:
        raise SystemExit(f"{setup.name} has no programs {sorted(missing)}")
    for compiled in compile_programs(engine, programs, jobs=JOBS):
        key = engine_key(setup, compiled.facts.name)
        results["audits"][key] = audit_program(compiled.hlo_text, compiled.facts, compiled.memory, compiled.thunks)
        results["compile_seconds"][key] = compiled.compile_seconds


def _audit_examples(results: dict) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.gpu_programs.audit import audit_program
    from jaxserve.gpu_programs.build import memory_of
    from jaxserve.gpu_programs.target import load_target, target_devices
    from jaxserve.gpu_programs.thunks import read_thunks
    from tests.gpu_audit_examples import EXAMPLES

    replicated = NamedSharding(Mesh(target_devices(load_target("h100"), 1), ("devices",)), P())
    for example in EXAMPLES:
        with tempfile.TemporaryDirectory() as dumps:
            started = time.perf_counter()
            # Under the target's abstract mesh, Pallas lowers its kernels to Triton for that GPU (no device asked).
            with jax.sharding.use_abstract_mesh(replicated.mesh.abstract_mesh):
                lowered = jax.jit(example.function).lower(*example.specs(replicated))
            compiled = lowered.compile(compiler_options={**example.compiler_options, "xla_dump_to": dumps})
            results["compile_seconds"][example_key(example.name)] = time.perf_counter() - started
            thunks = read_thunks(Path(dumps))
        results["audits"][example_key(example.name)] = audit_program(compiled.as_text(), example.facts(),
                                                                     memory_of(compiled), thunks)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
