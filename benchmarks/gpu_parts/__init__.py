"""The parts of benchmarks/gpu_check.py, one registry entry each: a later feature (quantized weights, speculative
decoding) adds a module here and one Part to PARTS, not a script.

A part's module defines `run(context: PartContext, **args) -> PartOutcome`. The orchestrating process never imports
it: every part runs in a process of its own, under its time budget, so a crash, an out-of-memory or a hang costs that
part only, and the GPU memory it claimed is freed before the next starts.

Budgets are wall-clock limits in seconds, process start and JAX's import included. Each group's GPU budgets add up to
8.2 minutes at most, so that a group, with the wheels' install before it, fits one 10-minute command. Group 1 is
the one to run first when GPU time is short: decode against the spec and measured rooflines with a profile of its
steps, and the step programs compiled on the device against the deviceless build (issue 34's measurements). Group
2 validates the engine's numerics and measures pallas against xla attention; group 3 measures quantized weights and
serving over HTTP; group 4 what serving LoRA adapters costs (the engine, and the delta's forms) and the host's work
per step on the GPU host's CPU; group 5 what structured output costs, speculative decoding, and batch-1 decode
with the layer loop in one CUDA graph; group 6 checks and times the Pallas kernels alone; group 7 times the
engine's start-up: cold and warm compilation cache, then filling a program store and starting from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GROUPS = (1, 2, 3, 4, 5, 6, 7)


@dataclasses.dataclass(frozen=True)
class Part:
    """One isolated piece of the GPU check."""

    name: str  # its key in the report and in --parts
    group: int  # which group of a whole run it belongs to (--group)
    budget_s: float  # wall-clock limit on a GPU; past it the part's processes are ended and it is reported timed out
    smoke_budget_s: float  # the same limit with --smoke (CPU, tiny shapes, kernels interpreted)
    run: str  # "module:function" (a module of this package), imported in the part's own process only
    gpu_args: dict[str, Any]  # keyword arguments of `run` on a GPU
    smoke_args: dict[str, Any]  # keyword arguments of `run` with --smoke
    about: str  # one line for --list and the report
    plot: str | None = None  # the PNG it writes into the output folder, None for none
    artifact: str | None = None  # another file it writes into the output folder (a trace), None for none


# Engine settings (benchmarks/engine_bench.py's flags) shared by engine_parity and engine_speed: the same
# EngineConfig compiles the same programs, so the second part finds them in JAX's persistent compilation cache.
# Batch 256 runs two Llama-3.1-8B engines (16 GB of weights each) in 45% of an 80 GB GPU each: 256-token prompts and a
# 1024-token step keep each pool near 15 GB.
ENGINE_GPU_ARGS = ["--engine-batches", "1", "64", "256", "--engine-prompt-len", "256", "--engine-batched-tokens",
                   "1024"]
ENGINE_SMOKE_ARGS = ["--smoke", "--engine-batches", "1", "2", "--engine-batched-tokens", "16"]  # few programs

# Batch-1 decode only, pallas against pallas with the layer loop in one CUDA graph: two engines whose pools hold one
# sequence, so their few programs compile fast and both fit beside each other on an 80 GB GPU.
GRAPHED_LOOP_GPU_ARGS = ["--engine-batches", "1", "--engine-prompt-len", "256", "--engine-batched-tokens", "256",
                         "--engine-rounds", "3", "--engine-variants", "pallas", "pallas-graphed-loop"]

# The engine's page size: EngineConfig.block_size's default, which every preset in configs/ keeps.
PAGE_SIZE = 16

# benchmarks/speculative.py at the 8B shapes: two engines alive at once (without and with speculation), a small bucket
# grid (batches to 16, 128-token steps: about 25 programs to compile cold) and short runs, to fit its budget.
SPECULATIVE_GPU_ARGS = ["--model-shape", "llama-3.1-8b", "--dtype", "bfloat16", "--mem-fraction", "0.45",
                        "--batch-sizes", "1", "16", "--waves", "2", "--output-len", "64", "--rounds", "2",
                        "--max-num-batched-tokens", "128", "--units", "12", "--copied-units", "4"]

# benchmarks/lora.py at the 8B shapes: one copy of the weights (16 GB) run by two engines in one process, with and
# without adapter slots (each pool 32 sequences of 192 tokens, 0.8 GB); a small bucket grid (28 programs per engine,
# compiled cold, neither engine's programs being the other's) and about 150 steps per batch, to fit its budget.
LORA_GPU_ARGS = ["--model-shape", "llama-3.1-8b", "--dtype", "bfloat16", "--max-num-seqs", "32",
                 "--max-num-batched-tokens", "512", "--num-requests", "64", "--prompt-len", "128", "--max-tokens", "64",
                 "--num-adapters", "4", "--rank", "16", "--rounds", "3"]
# The limits of tests/test_lora_engine.py's engines (2 slots of rank 8; max_num_seqs 4, max_num_batched_tokens 64,
# max_model_len 128), as tests/test_benchmark_lora.py runs them: their programs are in the compilation cache.
LORA_SMOKE_ARGS = ["--num-requests", "4", "--prompt-len", "8", "--max-tokens", "4", "--rounds", "2",
                   "--num-adapters", "2", "--rank", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                   "--max-model-len", "128"]

# benchmarks/structured_output.py at the 8B shapes: 64 sequences (11 decode buckets, 5 mixed ones of up to 256 tokens
# and their samplers, about 40 programs cold) and 64 requests per mode and round (its KV pool: gpu_parts/
# structured_output.py).
STRUCTURED_GPU_ARGS = ["--model-shape", "llama-3.1-8b", "--dtype", "bfloat16", "--max-num-seqs", "64", "--requests",
                       "64", "--rounds", "3", "--seqs", "64", "--steps", "40"]
STRUCTURED_SMOKE_ARGS = ["--requests", "4", "--rounds", "1", "--max-num-seqs", "4", "--seqs", "4", "--vocab", "3000",
                         "--steps", "4"]

# The step programs audited on the device against the deviceless build: the decode programs the engine runs most
# (batch 1 and 64), a short and a long mixed step, and the samplers of 1 and 64 rows (a sort's library may differ).
AUDITED_PROGRAMS = "decode S=(1|64)$|mixed T=(512|8192) S=64$|sampler S=(1|64)$"
AUDITED_PRESET = "configs/llama-3.1-8b-h100.yaml"

# Attention shapes of the Llama-3.1-8B kernels (32 query heads over 8 KV heads of 128) and their GQA-8 sibling.
LLAMA_8B_DECODE = ["--batches", "64", "--contexts", "2048"]
LLAMA_8B_PREFILL = ["--prefill-shapes", "1x2048", "8x1024", "16x128", "--prefill-priors", "0", "2048"]

PARTS = [
    Part("env", 1, 30, 60, "gpu_parts.env:run", {}, {},
         "device, driver, CUDA, jax/jaxlib and package versions; every module the parts import"),
    # decode_profile: one cold pallas engine (ready in 27 s on the last H100 run), 3 batches x 2 rounds of timed
    # decode (about 40 s there), then 2 profiled runs (prefill, warm-up, 20 traced steps, the trace's export): about
    # 150 s.
    Part("decode_profile", 1, 240, 240, "gpu_parts.decode_profile:run",
         dict(args=[*ENGINE_GPU_ARGS, "--engine-rounds", "2", "--engine-variants", "pallas"], profile_batches=[1, 64],
              profile_steps=20),
         dict(args=[*ENGINE_SMOKE_ARGS, "--engine-variants", "pallas"], profile_batches=[1, 2], profile_steps=3),
         "8B-shaped pallas decode at batch 1/64/256 against the spec and measured-copy rooflines (copy rate "
         "cross-checked); a profile of 20 steps at batch 1 and 64: kernels per step, GPU busy fraction, top kernels "
         "per named scope", artifact="decode_profile.trace.json.gz"),
    # program_audit: 7 programs compiled on an H100 took 16 s (plus about 20 s to start and build the engine); the
    # deviceless build of these 6 takes 12 s on 2 cores.
    Part("program_audit", 1, 150, 120, "gpu_parts.program_audit:run",
         dict(config=AUDITED_PRESET, target="auto", programs=AUDITED_PROGRAMS,
              builds={"deviceless": [], "on device": ["--on-device"]}),
         # No GPU: a second deviceless build with Triton GEMMs stands in for the device's, so that the
         # comparison has differences to show.
         dict(config=AUDITED_PRESET, target="h100", programs="decode S=1$|sampler S=1$",
              builds={"deviceless": [], "deviceless, Triton GEMMs": ["--gemm-backend", "triton"]}),
         "the 8B H100 preset's decode, mixed and sampler programs compiled on the GPU (autotuned) against the "
         "deviceless build: temp, GEMM backends, copies, launches per layer, CUDA graphs, moved/must-read"),
    Part("ceilings", 1, 45, 60, "gpu_parts.ceilings:run",
         dict(copy_mib=1024, matmul_size=8192, reps=20, warmup=3),
         dict(copy_mib=16, matmul_size=256, reps=3, warmup=1),
         "HBM copy bandwidth (cross-checked by a memcpy and a read-only reduction), bf16 and fp8 matmul rates, "
         "dispatch floor"),
    # engine_parity's budget: on the last H100 run the xla engine was ready in 90 s (cold, its GEMMs autotuned) and the
    # pallas one in 27 s; the float32 reference now compiles 6 programs (estimated well under a minute) and scores in
    # about 420 16-token steps (~15 s): about 200 s in all, so 320 s alone (--parts engine_parity) fits a 450 s command.
    # engine_speed after it took 110 s there (its programs from engine_parity's compilation cache): group 2 stays 480 s.
    Part("engine_parity", 2, 320, 180, "gpu_parts.engine_parity:run",
         dict(engine_args=ENGINE_GPU_ARGS, prompts=32, new_tokens=64, min_prompt_len=16),
         dict(engine_args=ENGINE_SMOKE_ARGS, prompts=6, new_tokens=12, min_prompt_len=4),
         "the 8B-shaped engine, attention pallas vs xla: log-probabilities of the same tokens against a float32 "
         "engine, and greedy tokens identical or the first divergence"),
    Part("engine_speed", 2, 160, 180, "gpu_parts.engine_speed:run",
         dict(args=[*ENGINE_GPU_ARGS, "--engine-rounds", "2"]),
         dict(args=ENGINE_SMOKE_ARGS),
         "batch-1 decode against the HBM roofline (spec and measured copy), throughput at 64 and 256 sequences, "
         "pallas vs xla; host time per step phase",
         plot="engine.png"),
]
PARTS += [
    Part("quantized_engine", 3, 300, 240, "gpu_parts.engine_speed:run",
         dict(args=["--engine-batches", "1", "64", "--engine-prompt-len", "256", "--engine-batched-tokens", "1024",
                    "--engine-rounds", "2", "--engine-variants", "pallas", "pallas-int8", "pallas-int8-gemm-pallas",
                    "pallas-fp8", "pallas-fp8-gemm-pallas", "pallas-int4", "--engine-grow-memory",
                    "--engine-mem-fraction", "0.9"]),
         dict(args=[*ENGINE_SMOKE_ARGS, "--engine-variants", "pallas", "pallas-int8-gemm-pallas", "pallas-int4"]),
         "decode with int8 / fp8 weights, through XLA's GEMMs and through the Pallas W8A16 kernel (--gemm-backend "
         "pallas), and with 4-bit weights through the Pallas W4A16 kernel, against bf16, batch 1 and 64, in one run",
         plot="quantized_engine.png"),
    Part("serve", 3, 190, 180, "gpu_parts.serving:run",
         dict(model="llama-3.1-8b", dtype="bfloat16", config="configs/llama-3.1-8b-h100.yaml", concurrency=[16, 64],
              seconds_per_level=30, input_len=512, output_len=128, max_prompts=4000),
         dict(model="builtin", dtype="float32", config="configs/tiny-cpu.yaml", concurrency=[2, 4],
              seconds_per_level=2, input_len=16, output_len=8, max_prompts=200),
         "jaxserve serve over HTTP for 60 s (concurrency 16, then 64): TTFT and TPOT p50/p95", plot="serve.png"),
    Part("lora", 4, 300, 240, "gpu_parts.lora:run", dict(args=LORA_GPU_ARGS), dict(args=LORA_SMOKE_ARGS),
         "LoRA on the 8B-shaped engine: a batch on the base model vs spread over 4 adapters of rank 16, and vs an "
         "engine without LoRA (tokens/s, ratios within each round)", plot="lora.png"),
    Part("lora_kernels", 4, 120, 120, "gpu_parts.lora_kernels:run", dict(args=[]), dict(args=["--smoke"]),
         "the LoRA delta's one-hot (the engine's), gather and Pallas forms per 8B projection and token count, "
         "against the projection itself", plot="lora_kernels.png"),
    Part("host_overhead", 4, 60, 120, "gpu_parts.host_overhead:run",
         dict(args=["--skip-decode", "--num-seqs", "64", "256", "--cycles", "200", "--warm-cycles", "30"]),
         dict(args=["--skip-decode", "--num-seqs", "8", "--cycles", "20", "--warm-cycles", "5"]),
         "the host's work per step on this host's CPU (schedule + prepare, update + outputs at 64 and 256 decoding "
         "sequences; no device work) against the <= 1 ms targets"),
    Part("structured_output", 5, 240, 180, "gpu_parts.structured_output:run", dict(args=STRUCTURED_GPU_ARGS),
         dict(args=STRUCTURED_SMOKE_ARGS),
         "structured output: host ms to fill 64 grammar masks over a 128k vocabulary, in parallel and on one thread; "
         "the 8B-shaped engine's tokens/s constrained vs unconstrained (target 0.9x), vs masks on one thread and vs "
         "no async overlap"),
    Part("speculative", 5, 130, 180, "gpu_parts.speculative:run",
         dict(args=SPECULATIVE_GPU_ARGS), dict(args=["--smoke"]),
         "speculative decoding vs none, 8B-shaped engine at batch 1 and 16: n-gram drafts, and replayed drafts at "
         "acceptance 0-1 (steps per token, verify-step cost, wall speed-up)", plot="speculative.png"),
    Part("graphed_loop", 5, 110, 180, "gpu_parts.engine_speed:run",
         dict(args=GRAPHED_LOOP_GPU_ARGS),
         dict(args=[*ENGINE_SMOKE_ARGS, "--engine-batches", "1", "--engine-variants", "pallas", "pallas-graphed-loop"]),
         "batch-1 decode, pallas vs pallas with the scanned layers' loop in one CUDA graph (what the per-layer "
         "launches cost)", plot="graphed_loop.png"),
    Part("kernel_check", 6, 120, 120, "gpu_parts.kernel_check:run",
         dict(kinds=["decode", "prefill", "mixed"], groups=[1, 4, 8], head_dims=[64, 128], page_sizes=[PAGE_SIZE],
              kv_heads=8, long_len=1000),
         dict(kinds=["decode", "prefill", "mixed"], groups=[4], head_dims=[64], page_sizes=[PAGE_SIZE], kv_heads=1,
              long_len=40),
         "every Pallas kernel compiled and checked against the XLA reference on random ragged batches"),
    Part("kernel_timing", 6, 200, 120, "gpu_parts.kernel_timing:run",
         dict(runs={"llama-3.1-8b (32/8 heads)": [*LLAMA_8B_DECODE, "--skip-prefill", "--reps", "10"],
                    # The prefill kernel's goal points (1 x 2048 and 8 x 1024 prompts, 16 x 128 chunks over 2048
                    # cached tokens), each with the default tuning and its neighbours (--sweep).
                    "llama-3.1-8b prefill (32/8 heads)": ["--skip-decode", *LLAMA_8B_PREFILL, "--sweep", "--reps",
                                                          "5"],
                    "GQA 8 (64/8 heads)": [*LLAMA_8B_DECODE, "--heads", "64", "--skip-prefill", "--reps", "10"]}),
         dict(runs={"smoke": ["--smoke", "--batches", "3", "--contexts", "40", "--prefill-shapes", "2x16",
                              "--prefill-priors", "0"]}),
         "decode 64 x 2k and prefill against copy bandwidth / matmul rate, JAX's shipped op and XLA",
         plot="kernels.png"),
    Part("startup", 7, 300, 120, "gpu_parts.startup_time:run",
         dict(args=["--model", "llama-3.1-8b", "--layers", "32", "--max-num-seqs", "64",
                    "--max-num-batched-tokens", "8192", "--max-model-len", "8192", "--store"]),
         dict(args=["--model", "builtin", "--layers", "2", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                    "--max-model-len", "64", "--dtype", "float32", "--store"]),
         "engine start-up at the 8B preset's shapes: cold and warm compilation cache, then filling a program store "
         "and starting from it", plot="startup.png"),
]
PARTS_BY_NAME = {part.name: part for part in PARTS}
