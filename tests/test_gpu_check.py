"""benchmarks/gpu_check.py: each group of its registry fits one 10-minute command and a flat, small results folder; a
--smoke run on the CPU, group by group, passes every part and merges them into one report; a part that fails or
hangs is reported while the others still run. The readers of the GPU-only figures on hand-made inputs: a profiler
trace of decode steps (step_trace.py) and the comparison of two builds' program audits (program_audit.py)."""

from __future__ import annotations

import gzip
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
from gpu_parts import GROUPS, PARTS, PARTS_BY_NAME  # noqa: E402
from gpu_parts.env import parse_gpu_rows  # noqa: E402
from gpu_parts.kernel_check import Case, kernel_variant, ragged_batch  # noqa: E402
from gpu_parts.isolation import GRACE_S  # noqa: E402
from gpu_parts.report import COMBINED_LOG, REPORT_JSON, REPORT_MARKDOWN  # noqa: E402
from gpu_parts.context import PartContext  # noqa: E402
from gpu_parts.engine_parity import REFERENCE, log_prob_errors, reference_settings  # noqa: E402
from gpu_parts import structured_output as structured_part  # noqa: E402
from gpu_parts.serving import cover_vocabulary  # noqa: E402
from gpu_parts import lora as lora_part  # noqa: E402
from gpu_parts import program_audit, step_trace  # noqa: E402
from gpu_parts.decode_profile import spec_targets  # noqa: E402
import lora as lora_benchmark  # noqa: E402
import structured_output as structured_benchmark  # noqa: E402
from engine_bench import ENGINE_VARIANTS, engine_config, engine_settings, parse_args  # noqa: E402
from model_shapes import LLAMA3_8B_CONFIG  # noqa: E402
from jaxserve.engine.kv_sizing import bytes_per_page  # noqa: E402
from jaxserve.model.config import LlamaConfig  # noqa: E402
from jaxserve.runner.buckets import BucketSet  # noqa: E402
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR  # noqa: E402
from jaxserve.tokenizer import load_tokenizer  # noqa: E402

COMMAND_LIMIT_S = 10 * 60
SETUP_ALLOWANCE_S = 90  # installing the carried wheels and starting, before the first part
MAX_OUT_FILES = 8  # each group's results are collected from a flat folder of at most this many files
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
SMOKE_TIMEOUT_S = 900  # about 90 s on an idle 2-core machine with a warm compilation cache
PNG_MAGIC = b"\x89PNG"


def test_each_group_fits_one_ten_minute_command_even_if_every_part_times_out():
    assert {part.group for part in PARTS} == set(GROUPS)
    assert len({part.name for part in PARTS}) == len(PARTS)
    for group in GROUPS:
        parts = [part for part in PARTS if part.group == group]
        worst_s = sum(part.budget_s + GRACE_S for part in parts)
        assert worst_s + SETUP_ALLOWANCE_S < COMMAND_LIMIT_S, (group, worst_s)


def part_files(parts) -> list[str]:
    """The files parts write into the results folder besides the reports: plots and artifacts (a trace)."""
    return [name for part in parts for name in (part.plot, part.artifact) if name]


def test_results_folder_stays_flat_small_and_plainly_named():
    reports = [REPORT_JSON, REPORT_MARKDOWN, COMBINED_LOG]
    names = reports + part_files(PARTS)
    assert len(set(names)) == len(names) and all(OUT_NAME.match(name) for name in names)
    for group in GROUPS:
        assert len(reports + part_files(part for part in PARTS if part.group == group)) <= MAX_OUT_FILES


def test_listing_names_every_part_and_each_groups_budget():
    text = gpu_check.listing()
    assert all(part.name in text for part in PARTS)
    assert "group 1: 465 s" in text and "group 2: 480 s" in text and "group 3: 490 s" in text
    assert "group 4: 480 s" in text and "group 5: 480 s" in text and "group 6: 320 s" in text
    assert "group 7: 300 s" in text


def test_the_first_group_measures_decode_against_its_rooflines_before_anything_else():
    """Issue 34's figures come first: a session with one GPU command still gets decode against the spec roofline,
    its profile and the on-device audit."""
    first = [part.name for part in PARTS if part.group == 1]
    assert first[:3] == ["env", "decode_profile", "program_audit"]
    assert PARTS_BY_NAME["program_audit"].gpu_args["builds"] == {"deviceless": [], "on device": ["--on-device"]}


def test_nvidia_smi_query_rows_parse_into_named_fields():
    rows = parse_gpu_rows("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB, 1980 MHz, 2619 MHz, 700.00 W, "
                          "00000000:00:05.0\n\n")
    assert rows == [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.159.04", "memory.total": "81559 MiB",
                     "clocks.max.sm": "1980 MHz", "clocks.max.memory": "2619 MHz", "power.limit": "700.00 W",
                     "pci.bus_id": "00000000:00:05.0"}]


def greedy_output(tokens: list[int], logprobs: list[float], runner_up: int) -> RequestOutput:
    entries = [{token: Logprob(value, 1, ""), runner_up: Logprob(value - 0.01, 2, "")}
               for token, value in zip(tokens, logprobs)]
    completion = CompletionOutput(0, "", tuple(tokens), None, entries, "length", None)
    return RequestOutput("0", None, (), [completion], True)


def test_engine_parity_passes_bf16_noise_and_fails_a_kernel_that_moves_log_probabilities():
    rng = np.random.default_rng(0)
    prompt, continuation = [1, 2, 3], [4, 5, 6, 7]
    sequence = prompt + continuation
    reference = rng.normal(-11.0, 0.3, len(sequence) - 1)  # the score of each token after the first

    def run_of(offsets: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, RequestOutput]:
        scored = reference + offsets
        return scored, greedy_output(tokens, list(scored[len(prompt) - 1:]), runner_up=99)

    xla_scores, xla = run_of(rng.normal(0, 0.01, reference.size), continuation)
    noisy_scores, noisy = run_of(rng.normal(0, 0.01, reference.size), [4, 5, 99, 8])  # leaves at a near tie
    wrong_scores, wrong = run_of(rng.normal(0, 0.01, reference.size) + np.arange(reference.size) * 0.1, continuation)

    def verdicts(pallas_scores: np.ndarray, pallas: RequestOutput) -> dict:
        return log_prob_errors([prompt], [sequence], {"pallas": [pallas], "xla": [xla]},
                               {"pallas": [pallas_scores], "xla": [xla_scores], REFERENCE: [reference]})

    noise = verdicts(noisy_scores, noisy)
    assert noise["log_prob_verdicts"] == {"prefill": True, "decode": True}
    assert noise["log_prob_errors"]["pallas"]["decode"]["positions"] == 2  # the run's tokens on the sequence
    assert verdicts(wrong_scores, wrong)["log_prob_verdicts"] == {"prefill": False, "decode": False}


def test_engine_parity_reference_compiles_one_decode_and_one_mixed_shape_at_the_gpu_settings():
    """On an H100 the float32 reference engine (one batch of 32 rows, 1024-token steps: 38 programs over 12 row
    counts) was still starting when the part's budget ran out. Scoring one sequence at a time in 16-token steps, it
    compiles two step shapes (and their variants), holds the longest scored sequence, and its pool one sequence."""
    part = PARTS_BY_NAME["engine_parity"].gpu_args
    settings = engine_settings(parse_args(part["engine_args"]))
    longest = [0] * (settings.prompt_len + part["new_tokens"])
    config = engine_config(reference_settings(settings, [longest] * part["prompts"]), ENGINE_VARIANTS["xla"])
    buckets = BucketSet.for_limits(config.max_num_batched_tokens, config.max_num_seqs).all_buckets()
    assert {(bucket.num_tokens, bucket.num_seqs) for bucket in buckets} == {(1, 1), (16, 1)} and len(buckets) == 5
    assert config.max_model_len >= len(longest)
    assert config.num_kv_pages == -(-config.max_model_len // config.block_size) + 1
    with pytest.raises(ValueError, match="exceeds the reference engine"):
        reference_settings(settings, [[0] * (config.max_model_len + 1)])


def test_structured_output_part_sizes_its_pool_to_its_sequences_not_to_device_memory():
    """The pool sized from memory failed to allocate one 22 GiB K (or V) array on an H100; the part's pool holds the
    run's 64 sequences of the benchmark's longest with room, and stays below the 20 GB that passed there."""
    args = PARTS_BY_NAME["structured_output"].gpu_args["args"]
    gpu, smoke = (PartContext(Path("out"), Path("work"), smoke, None) for smoke in (False, True))
    assert structured_part.script_args(smoke, args) == args
    gpu_args = structured_part.script_args(gpu, args)
    pool_gib = float(gpu_args[gpu_args.index("--kv-cache-memory-gb") + 1])
    benchmark = structured_benchmark.parse_args(gpu_args)
    per_page = bytes_per_page(LlamaConfig.from_hf_dict(LLAMA3_8B_CONFIG), 16, np.dtype("bfloat16"))
    needed = benchmark.max_num_seqs * -(-structured_benchmark.MAX_MODEL_LEN // 16) * per_page
    assert benchmark.model_shape == "llama-3.1-8b" and 2 * needed <= pool_gib * 2**30 <= 20e9
    assert structured_part.script_args(gpu, [*args, "--kv-cache-memory-gb", "3"])[-1] == "3"  # theirs wins


def test_random_checkpoints_tokenizer_spells_every_id_the_model_can_sample(tmp_path):
    for source in BUILTIN_MODEL_DIR.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    builtin = load_tokenizer(BUILTIN_MODEL_DIR)
    vocab_size = builtin.vocab_size + 300
    cover_vocabulary(tmp_path / "tokenizer.json", vocab_size)
    widened = load_tokenizer(tmp_path)

    assert widened.vocab_size == vocab_size
    assert [widened.decode([i]) for i in range(builtin.vocab_size)] == [builtin.decode([i])
                                                                        for i in range(builtin.vocab_size)]
    assert [widened.decode([i]) for i in range(builtin.vocab_size, vocab_size)] == [
        f"[{i}]" for i in range(builtin.vocab_size, vocab_size)]
    text = "The capital of France is Paris. 1234 [12]"
    assert widened.encode(text) == builtin.encode(text)


def test_lora_part_reports_tokens_per_s_per_variant_and_the_ratios_from_the_benchmarks_json():
    speeds = {"base": [100, 80], "adapters": [90, 64], "lora-off": [125, 100]}  # tokens/s per round
    runs = {variant: [lora_benchmark.RunResult(wall_s=1.0, generated_tokens=speed, steps=2, outputs=((1,),))
                      for speed in per_round] for variant, per_round in speeds.items()}
    report = {"model": "random llama-3.1-8b", "dtype": "bfloat16", "engine_programs": {"lora-on": 28, "lora-off": 28},
              "settings": vars(lora_benchmark.parse_args(PARTS_BY_NAME["lora"].gpu_args["args"])),
              "target_adapters_vs_base": lora_benchmark.TARGET_ADAPTERS_VS_BASE, **lora_benchmark.summarize(runs)}
    rows = lora_part.variant_rows(report)
    assert [(row["variant"], row["engine"], row["tokens_per_s"], row["vs_base"]) for row in rows] == [
        ("base", "lora-on", 90, 1.0), ("adapters", "lora-on", 77, 77 / 90), ("lora-off", "lora-off", 112.5, 1.25)]
    figures = {"rows": rows, "ratios": report["ratios"], "meets_target": report["meets_target"],
               "checks": report["checks"], "compiles_after_warmup": {"lora-on": 0, "lora-off": 0},
               "engine_startup_s": {"lora-on": 60.0, "lora-off": 50.0}}
    text = lora_part.summary(figures, report)
    assert "| adapters / base | 0.85x | 0.90 0.80 |" in text and "| base / lora-off | 0.80x | 0.80 0.80 |" in text
    assert "| adapters | lora-on | 77.0 | 90.0 64.0 |" in text and "target of 0.8x: met" in text
    assert "lora-on 60 s (28 programs)" in text and "64 requests x 64 tokens" in text


def test_every_kernel_check_case_of_the_gpu_run_lowers_for_an_h100():
    """The Pallas-to-Triton lowering of each case kernel_check compiles on a GPU passes here, on the CPU, so a GPU run
    spends its budget on checking the kernels rather than on cases that cannot lower."""
    from kernels import build_inputs
    from tests.cuda_lowering import export_for_h100, triton_calls

    grid = PARTS_BY_NAME["kernel_check"].gpu_args
    for kind, group, head_dim, page in itertools.product(grid["kinds"], grid["groups"], grid["head_dims"],
                                                          grid["page_sizes"]):
        case = Case(kind, group, head_dim, page, grid["kv_heads"])
        batch = ragged_batch(kind, page, grid["long_len"])
        variant = kernel_variant(case, batch, interpret=False)
        inputs = jax.eval_shape(lambda: build_inputs(batch, case.shape, rotate_bytes=0, seed=0)[0])
        exported = export_for_h100(variant.run, *jax.eval_shape(variant.arguments, inputs))
        assert triton_calls(exported) >= 1, case.label


# A decode step's forward program as XLA:GPU prints it, cut to what the trace reader uses: a layer loop whose fusion
# has no metadata of its own (it takes its fused computation's) and whose GEMM has, and a logits GEMM after it.
FORWARD_HLO = """HloModule jit_run_packed_forward, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_norm (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="LAYER/mul"}
}

%body (c: f32[4]) -> f32[4] {
  %c = f32[4]{0} parameter(0)
  %loop_multiply_fusion.1 = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_norm
  ROOT %custom-call.3 = f32[4]{0} custom-call(%loop_multiply_fusion.1), metadata={op_name="LAYER/dot_general"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %while.2 = f32[4]{0} while(%x), condition=%cond, body=%body, metadata={op_name="jit(f)/layers/while"}
  ROOT %dot.7 = f32[4]{0} custom-call(%while.2), metadata={op_name="jit(f)/logits/dot_general"}
}
""".replace("LAYER", "jit(f)/layers/while/body/decoder_layer")
WINDOW = "profiled steps"


def kernel(tid: int, name: str, ts: float, dur: float, hlo_op: str | None = None) -> dict:
    args = {"hlo_op": hlo_op, "hlo_module": "jit_run_packed_forward"} if hlo_op else {}
    return {"ph": "X", "pid": 2, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def gpu_trace() -> dict:
    """Two decode steps on a GPU as the profiler writes them: the window's host annotation (100-300 us), a host
    thunk annotation naming an instruction, kernels and a host-to-device copy on two stream lines, a derived
    "XLA Ops" line repeating a kernel, and a kernel that started before the window."""
    names = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
             {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
             {"ph": "M", "pid": 2, "tid": 10, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
             {"ph": "M", "pid": 2, "tid": 11, "name": "thread_name", "args": {"name": "Stream #8(MemcpyH2D)"}},
             {"ph": "M", "pid": 2, "tid": 12, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    host = [{"ph": "X", "pid": 1, "tid": 1, "ts": 100, "dur": 200, "name": WINDOW},
            {"ph": "X", "pid": 1, "tid": 1, "ts": 110, "dur": 5, "name": "Thunk", "args": {"hlo_op": "custom-call.3"}}]
    device = [kernel(10, "input_reduce_fusion", 50, 60, "while.2"), kernel(11, "MemcpyH2D", 115, 10),
              kernel(10, "loop_multiply_fusion_1", 120, 10, "loop_multiply_fusion.1"),
              kernel(10, "sm90_xmma_gemm_bf16", 130, 40, "custom-call.3"),
              kernel(10, "loop_multiply_fusion_1", 200, 10, "loop_multiply_fusion.1"),
              kernel(10, "sm90_xmma_gemm_bf16", 210, 40, "custom-call.3"),
              kernel(10, "nvjet_logits", 260, 30, "dot.7"), kernel(12, "custom-call.3", 130, 40, "custom-call.3")]
    return {"displayTimeUnit": "ns", "traceEvents": names + host + device}


def write_trace(folder: Path, trace: dict) -> None:
    run = folder / "plugins" / "profile" / "2026_11_27_10_00_00"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as stream:
        json.dump(trace, stream)


def test_a_gpu_trace_of_two_steps_reads_into_kernels_busy_time_and_scopes(tmp_path):
    write_trace(tmp_path / "trace", gpu_trace())
    (tmp_path / "forward.hlo.txt").write_text(FORWARD_HLO)
    summary, excerpt = step_trace.read_profile(tmp_path / "trace", WINDOW, 2, [str(tmp_path / "forward.hlo.txt")])
    # Started in the window: 5 kernels and 1 copy. Busy: 100-110 (the early kernel), 115-170, 200-250, 260-290.
    assert summary["kernels_per_step"] == 2.5 and summary["copies_per_step"] == 0.5
    assert summary["busy_fraction"] == pytest.approx(145 / 200) and summary["ms_per_step"] == pytest.approx(0.1)
    assert summary["device_ms_per_step"] == pytest.approx(0.07)
    assert [(s["scope"], s["launches_per_step"], s["ms_per_step"]) for s in summary["scopes"]] == [
        ("layers/decoder_layer", 2, pytest.approx(0.05)), ("logits", 0.5, pytest.approx(0.015)),
        (step_trace.UNATTRIBUTED, 0.5, pytest.approx(0.005))]
    assert summary["attributed_fraction"] == pytest.approx(130 / 140)
    top = summary["top_kernels"][0]
    assert (top["scope"], top["hlo_op"], top["kernel"], top["calls_per_step"], top["us_per_call"]) == (
        "layers/decoder_layer", "custom-call.3", "sm90_xmma_gemm_bf16", 1, 40)
    assert {e.get("name") for e in excerpt if e["ph"] == "X"} >= {WINDOW, "nvjet_logits", "input_reduce_fusion"}
    assert not [e for e in excerpt if e.get("tid") == 12]  # the derived line stays out


def test_host_thunks_stand_in_for_kernels_only_when_asked():
    trace = gpu_trace()
    assert "Thunk" not in {e.name for e in step_trace.device_events(trace)}
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("pid") != 2]  # a trace without CUPTI's events
    assert step_trace.device_events(trace) == []
    assert [e.name for e in step_trace.device_events(trace, host_thunks=True)] == ["Thunk"]


def test_kernels_overlapping_by_a_rounding_both_count_and_a_thunk_around_others_does_not():
    line = [{"pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0005, "name": "a"},
            {"pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0, "name": "b"},
            {"pid": 1, "tid": 1, "ts": 20.0, "dur": 30.0, "name": "while.5"},  # XLA:CPU's loop around its body
            {"pid": 1, "tid": 1, "ts": 21.0, "dur": 4.0, "name": "body op"}]
    assert [e["name"] for e in step_trace.innermost(line)] == ["a", "b", "body op"]


def test_a_kernel_belongs_to_the_innermost_named_scope_on_its_path():
    assert step_trace.scope_of("jit(f)/layers/while/body/decoder_layer/dot_general") == "layers/decoder_layer"
    assert step_trace.scope_of("jit(f)/layers/while/cond/lt") == "layers"
    assert step_trace.scope_of("jit(run_packed_sampling)/sample/sort") == "sample"
    assert step_trace.scope_of("jit(f)/gather") == step_trace.OUTSIDE_SCOPES
    assert step_trace.scope_of(None) == step_trace.UNATTRIBUTED


def test_excerpts_of_two_runs_share_one_trace_under_their_labels():
    trace = gpu_trace()
    events = step_trace.device_events(trace)
    part = step_trace.excerpt(trace, events, (100, 300), WINDOW)
    combined = step_trace.combined_trace({"batch 1": part, "batch 64": part})
    names = sorted(e["args"]["name"] for e in combined["traceEvents"] if e.get("name") == "process_name")
    assert names == ["batch 1: /device:GPU:0", "batch 1: /host:CPU", "batch 64: /device:GPU:0", "batch 64: /host:CPU"]
    assert len({e["pid"] for e in combined["traceEvents"]}) == 4


def audited(name: str, gemm: str, copies: int, temp_mib: int, graphs: int) -> dict:
    """An audit's program entry with what the comparison reads."""
    return {"name": name, "temp_bytes": temp_mib * 2**20, "gemms": [{"backend": gemm, "per_run": 161}],
            "custom_calls": {"__gpu$xla.gpu.triton": 32},
            "copies": [{"role": "weight", "per_run": copies, "bytes": 2**20}] if copies else [],
            "launches": {"per_layer": 20, "thunks": {"command_buffers": graphs, "in_command_buffers": 19,
                                                     "launches": 34}},
            "roofline": {"ratio": 1.0}, "rematerialized": 0}


def test_the_program_comparison_shows_each_build_where_they_differ_and_one_value_where_they_agree():
    reports = {"deviceless": {"programs": [audited("decode S=1", "__cublas$lt$matmul", 0, 32, 3)]},
               "on device": {"programs": [audited("decode S=1", "__triton_nested_gemm_fusion", 160, 400, 2),
                                          audited("sampler S=1", "xla fusion", 0, 2, 1)]}}
    rows = program_audit.compare(reports)
    assert [row["program"] for row in rows] == ["decode S=1", "sampler S=1"]
    assert rows[0]["differs"] == ["temp MiB", "GEMMs", "weight copies/run", "CUDA graphs"]
    assert rows[0]["cells"]["GEMMs"] == {"deviceless": "161 cublasLt", "on device": "161 tritonN"}
    assert rows[1]["cells"]["temp MiB"] == {"deviceless": "missing", "on device": "2"}
    figures = {"config": "c.yaml", "target": "h100", "programs": "decode", "comparison": rows,
               "builds": {"deviceless": [], "on device": ["--on-device"]},
               "audits": {label: {"report": {**report, "setup": {"device_kind": "NVIDIA H100 80GB HBM3",
                                                                 "num_kv_pages": 24335}}, "seconds": 9.0}
                          for label, report in reports.items()}}
    text = program_audit.summary(figures)
    assert ("| decode S=1 | **32 -> 400** | **161 cublasLt -> 161 tritonN** | 32 triton | **0 -> 160 = 160 MiB** |"
            in text)
    assert "2 of 2 programs differ" in text


def test_decode_targets_are_judged_on_the_spec_roofline_share_of_the_first_engine():
    engine = {"settings": {"variants": ["pallas"]},
              "summary": {"1": {"pallas": {"fraction_of_spec_roofline": 0.8}},
                          "64": {"pallas": {"fraction_of_spec_roofline": 0.5}}, "256": {"pallas": {}}}}
    assert spec_targets(engine) == {"1": {"target": 0.75, "measured": 0.8, "met": True},
                                    "64": {"target": 0.65, "measured": 0.5, "met": False}}


def run_gpu_check(out: Path, work: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--smoke", "--out", str(out),
                           "--work-dir", str(work), *flags], capture_output=True, text=True, cwd=REPO,
                          timeout=SMOKE_TIMEOUT_S)


def assert_figures_of_every_part(parts: dict) -> None:
    figures = {name: entry["outcome"]["figures"] for name, entry in parts.items()}
    assert figures["env"]["machine"]["jax_backend"] == "cpu" and figures["env"]["packages"]["jax"]
    for ceiling in ("matmul_bf16", "matmul_fp8", "matmul_fp8_cublas"):
        assert figures["ceilings"][ceiling]["flops_per_s"] > 0
    assert figures["ceilings"]["matmul_fp8_cublas"]["compiler_options"] == {"xla_gpu_enable_triton_gemm": False}
    assert all(figures["ceilings"][name]["bytes_per_s"] > 0 for name in ("copy", "memcpy", "read"))
    profiled = figures["decode_profile"]
    assert {(row["batch"], row["backend"]) for row in profiled["rows"]} == {(1, "pallas"), (2, "pallas")}
    for profile in profiled["profiles"].values():
        assert profile["kernels_per_step"] > 0 and 0 < profile["busy_fraction"] <= 1
        assert {"layers/decoder_layer", "logits", "sample"} <= {scope["scope"] for scope in profile["scopes"]}
    assert set(profiled["profiles"]) == {"1", "2"} and profiled["trace"]["written"]
    decode, sampler = figures["program_audit"]["comparison"]
    assert {"GEMMs", "weight copies/run"} <= set(decode["differs"]) and sampler["differs"] == []
    cases = figures["kernel_check"]["cases"]
    assert figures["kernel_check"]["interpret"] and {case["kind"] for case in cases} == {"decode", "prefill", "mixed"}
    assert all(case["passed"] and case["kernel_rel_error"] < 0.02 for case in cases)
    assert {row["grid"] for row in figures["kernel_timing"]["points"]} == {"decode", "prefill"}
    assert all(row["pallas_fraction"] > 0 for row in figures["kernel_timing"]["points"])
    startup = figures["startup"]["report"]
    assert [r["cache"] for r in startup["results"]] == ["cold", "warm", "store fill", "store"]
    assert startup["results"][-1]["sources"]["store"] == startup["results"][-1]["programs"] > 0
    assert set(startup["store_ratio"]) == {"2"}
    assert "from store / cache / compiled" in parts["startup"]["outcome"]["summary"]
    assert figures["engine_parity"]["identical"] and figures["engine_parity"]["first_divergence"] is None
    assert figures["engine_parity"]["log_prob_verdicts"] == {"prefill": True, "decode": True}
    assert all(row["host_phase_ms"]["dispatch"] > 0 for row in figures["engine_speed"]["rows"])
    assert {(row["batch"], row["backend"]) for row in figures["engine_speed"]["rows"]} == {
        (batch, backend) for batch in (1, 2) for backend in ("pallas", "xla")}
    assert {(row["batch"], row["backend"]) for row in figures["graphed_loop"]["rows"]} == {
        (1, "pallas"), (1, "pallas-graphed-loop")}
    assert {(row["batch"], row["backend"]) for row in figures["quantized_engine"]["rows"]} == {
        (batch, variant) for batch in (1, 2) for variant in ("pallas", "pallas-int8-gemm-pallas", "pallas-int4")}
    weights = {name: roofline["weight_bytes"]
               for name, roofline in figures["quantized_engine"]["weights_only_roofline"].items()}
    assert weights["pallas-int4"] < weights["pallas-int8-gemm-pallas"] < weights["pallas"]
    speculative = {(row["batch"], row["mode"]): row for row in figures["speculative"]["rows"]}
    assert figures["speculative"]["outputs_identical"] and speculative[(1, "replay@1")]["steps_vs_plain"] < 1
    for level in figures["serve"]["levels"]:
        assert level["completed"] > 0 and level["failed"] == 0 and level["ttft_ms"]["p95"] > 0
    lora = figures["lora"]
    assert [row["variant"] for row in lora["rows"]] == ["base", "adapters", "lora-off"]
    rounds = lora["report"]["settings"]["rounds"]
    assert all(row["tokens_per_s"] > 0 and len(row["tokens_per_s_per_round"]) == rounds for row in lora["rows"])
    assert list(lora["ratios"]) == ["adapters / base", "base / lora-off", "adapters / lora-off"]
    assert lora["checks"]["adapters_change_outputs"] > 0 and lora["checks"]["base_same_as_lora_off"]
    assert lora["compiles_after_warmup"] == {"lora-on": 0, "lora-off": 0}
    assert {row["projection"] for row in figures["lora_kernels"]["rows"]} == {"q_proj", "gate_proj"}
    assert all(row["pallas_us"] > 0 and row["worst_error"] < 1e-4 for row in figures["lora_kernels"]["rows"])
    host = figures["host_overhead"]["host_ms"]
    assert set(host) == {"8"} and host["8"]["update+outputs"]["median_ms"] > 0
    masks, throughput = figures["structured_output"]["masks"], figures["structured_output"]["throughput"]
    assert masks["identical_masks"] and set(masks["ms_per_step_median"]) == {"sequential", "parallel"}
    assert set(throughput["tokens_per_s_median"]) == {"constrained", "unconstrained", "constrained-no-overlap",
                                                      "constrained-sequential-masks"}
    assert throughput["valid_outputs"] == throughput["requests"] and throughput["parallel_over_sequential_masks"] > 0


@pytest.mark.slow
def test_smoke_run_group_by_group_passes_every_part_into_one_report(tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    for group in GROUPS:
        done = run_gpu_check(out, work, "--group", str(group))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / REPORT_JSON).read_text())
    assert list(report["parts"]) == [part.name for part in PARTS]
    for name, entry in report["parts"].items():
        assert entry["status"] == "ok", (name, entry.get("error"), entry.get("log_tail"))
        assert entry["seconds"] <= entry["budget_s"] and entry["outcome"]["summary"]
    assert_figures_of_every_part(report["parts"])
    assert [run["parts"] for run in report["runs"]] == [[p.name for p in PARTS if p.group == g] for g in GROUPS]
    assert all(run["finished_at"] and run["revision"]["source_sha256"] for run in report["runs"])
    files = sorted(path.name for path in out.iterdir())
    assert files == sorted([REPORT_JSON, REPORT_MARKDOWN, COMBINED_LOG] + part_files(PARTS))
    assert all((out / part.plot).read_bytes().startswith(PNG_MAGIC) for part in PARTS if part.plot)
    markdown = (out / REPORT_MARKDOWN).read_text()
    assert all(f"## {part.name}" in markdown and f"| {part.name} | {part.group} | ok |" in markdown for part in PARTS)


@pytest.mark.slow
def test_a_failing_and_a_hanging_part_are_reported_while_the_others_still_run(tmp_path):
    out = tmp_path / "results"
    done = run_gpu_check(out, tmp_path / "work", "--parts", "env,ceilings,startup", "--inject-fault", "env=raise",
                         "--inject-fault", "startup=hang", "--budget", "startup=3")
    assert done.returncode == 1, done.stdout + done.stderr
    parts = json.loads((out / REPORT_JSON).read_text())["parts"]
    assert parts["env"]["status"] == "error" and "fault injected into part env" in parts["env"]["log_tail"]
    assert parts["ceilings"]["status"] == "ok"
    assert parts["startup"]["status"] == "timeout" and parts["startup"]["seconds"] < 3 + GRACE_S + 5
    markdown = (out / REPORT_MARKDOWN).read_text()
    startup_group = PARTS_BY_NAME["startup"].group
    assert "| env | 1 | **error** |" in markdown and f"| startup | {startup_group} | **timeout** |" in markdown
    assert "fault injected into part env" in (out / COMBINED_LOG).read_text()
