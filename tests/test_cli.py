"""The `jaxserve` command: it generates on the built-in model, and bad input is one line and exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.errors import ConfigError
from jaxserve.config import EngineConfig, load_config

REPO = Path(__file__).resolve().parents[1]


def _jaxserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_on_the_builtin_model():
    result = _jaxserve("generate", "--config", "configs/tiny-cpu.yaml", "--prompt", "Hi", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("'Hi' -> ") and "[5 tokens, length]" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent/model"], "/nonexistent/model"),
    (["generate", "--dtype", "float7"], "unknown dtype"),
    (["generate", "--max-tokens", "-1"], "max_tokens must be >= 0"),
    (["generate", "--config", "configs/tiny-cpu.yaml", "--prompt", ""], "prompt is empty"),
    (["generate", "--config", "/nonexistent.yaml"], "config file not found"),
    (["convert", "/nonexistent/hf", "/tmp/out"], "/nonexistent/hf"),
    (["generate", "--tensor-parallel-size", "3"], "must divide the model's 4 attention heads"),
    (["generate", "--tensor-parallel-size", "2"], "needs that many devices"),  # the test process sees one CPU
    (["serve", "--coordinator", "127.0.0.1:1234"], "go together"),
    (["serve", "--stream-timeout", "0"], "stream_timeout_s must be positive"),
    (["serve", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'], "unknown method"),
    (["serve", "--api-keys-file", "/nonexistent/keys.yaml"], "api keys file not found"),
    (["serve", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["run-batch", "-i", "README.md", "-o", "/tmp/out.jsonl", "--lora-modules", "a=/x"],
     "--lora-modules needs --enable-lora"),
    (["serve", "--enable-lora", "--lora-modules", "a"], "must be name=path"),
    (["serve", "--api-key", "k", "--api-keys-file", "/nonexistent/keys.yaml"], "exclude each other"),
    (["serve", "--coordinator", "host0", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["serve", "--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "process_id must be in [0, 2)"),
    (["compile", "--target", "cpu"], "give --out DIR"),  # the CPU target builds a program store only
    (["compile", "--target", "cpu", "--out", "/tmp/store", "--audit", "/tmp/a.json"], "--audit audit or change"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = _jaxserve(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr, result.stderr
    # Progress bars may come first (the prompt is checked after start-up); the error is the one last line.
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("jaxserve: error: ") and message in last_line


def test_process_group_flags_default_to_the_environment(monkeypatch):
    from jaxserve.cli import _build_parser, _process_group

    monkeypatch.setenv("JAXSERVE_COORDINATOR", "leader.svc:1234")
    monkeypatch.setenv("JAXSERVE_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXSERVE_PROCESS_ID", "3")
    group = _process_group(_build_parser().parse_args(["serve", "--heartbeat-timeout", "7"]))
    assert (group.coordinator, group.num_processes, group.process_id, group.heartbeat_timeout_s) == (
        "leader.svc:1234", 4, 3, 7)
    assert not group.is_leader
    assert _process_group(_build_parser().parse_args(["serve", "--process-id", "0"])).is_leader


def test_vllms_tool_calling_flags_are_taken_and_an_unknown_parser_is_refused():
    from jaxserve.cli import _build_parser

    args = _build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    result = _jaxserve("serve", "--tool-call-parser", "pythonic")
    assert result.returncode == 2 and "argument --tool-call-parser: invalid choice: 'pythonic'" in result.stderr
    for name in ("hermes", "mistral"):
        assert _build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
    for name in ("qwen3", "deepseek_r1"):
        assert _build_parser().parse_args(["serve", "--reasoning-parser", name]).reasoning_parser == name
    result = _jaxserve("serve", "--reasoning-parser", "granite")
    assert result.returncode == 2 and "argument --reasoning-parser: invalid choice: 'granite'" in result.stderr


def test_flags_override_the_preset():
    config = load_config(REPO / "configs/tiny-cpu.yaml", {"max_num_seqs": 3, "dtype": None})
    assert config.max_num_seqs == 3 and config.dtype == "float32" and config.model is None


def test_an_unknown_flag_gets_the_subcommands_usage():
    result = _jaxserve("serve", "--max-num-seq", "3")
    assert result.returncode == 2
    assert "jaxserve serve: error: unrecognized arguments: --max-num-seq" in result.stderr
    assert "--max-num-seqs" in result.stderr  # the usage lists the flag meant


@pytest.mark.parametrize("command", ["serve", "generate", "run-batch", "convert", "compile"])
def test_every_commands_help_prints_its_flags(command, capsys):
    """Help text is formatted by argparse, where a lone % (a flag's "4% of max_model_len") once crashed --help."""
    from jaxserve.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"usage: jaxserve {command}")
    if command != "convert":
        assert "4% of max_model_len" in " ".join(printed.split())


@pytest.mark.parametrize("preset", sorted((REPO / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_preset_loads(preset):
    config = load_config(preset, {})
    assert config.max_num_seqs is not None and config.max_num_batched_tokens is not None


def test_gpu_presets_hold_the_documented_limits():
    h100 = load_config(REPO / "configs/llama-3.1-8b-h100.yaml", {})
    assert (h100.dtype, h100.max_num_seqs, h100.max_num_batched_tokens, h100.max_model_len) == (
        "bfloat16", 64, 8192, 8192)
    assert h100.gpu_memory_utilization == 0.92 and h100.enable_prefix_caching and h100.enable_chunked_prefill
    assert load_config(REPO / "configs/llama-3.1-70b-8xh100.yaml", {}).tensor_parallel_size == 8


def test_unset_step_limits_take_the_platforms_defaults():
    """vLLM's on a GPU; small ones on the CPU, where each compiled shape costs start-up seconds. Set ones stay."""
    gpu, cpu = EngineConfig().with_platform_defaults("gpu"), EngineConfig().with_platform_defaults("cpu")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (16, 512)
    assert EngineConfig(max_num_seqs=3).with_platform_defaults("gpu").max_num_seqs == 3
    with pytest.raises(ConfigError, match="max_num_seqs is not resolved"):
        EngineConfig().require("max_num_seqs")


@pytest.mark.parametrize("text, message", [
    ("max_num_seq: 3\n", "unknown setting 'max_num_seq'"),
    ("max_num_seqs: many\n", "wrong type"),
    ("- a list\n", "mapping"),
    ("key: [unclosed\n", "not valid YAML"),
])
def test_bad_presets_name_the_problem(tmp_path, text, message):
    preset = tmp_path / "preset.yaml"
    preset.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(preset, {})


def test_run_batch_and_profile_trace(tmp_path):
    source, target, trace = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "trace"
    source.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 3}}\n'
                      '{"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "Hi", "n": 0}}\n')
    result = _jaxserve("run-batch", "--config", "configs/tiny-cpu.yaml", "-i", str(source), "-o", str(target),
                       "--profile-dir", str(trace))
    assert result.returncode == 0, result.stderr
    assert "(1 succeeded, 1 failed)" in result.stdout
    assert [line.count('"status_code": 200') for line in target.read_text().splitlines()] == [1, 0]
    assert list(trace.rglob("*.xplane.pb")), "no profiler trace was written"
