"""Multi-host on one machine: two `jaxserve serve` processes on 127.0.0.1 joined by `jax.distributed`, 2 simulated
CPU devices each, one tensor-parallel mesh of 4 over both. Process 0 serves HTTP and schedules; process 1 runs the
broadcast steps. A greedy completion through process 0 must equal the single-process offline engine's, and killing
either process must end the other with an error within a bounded time, never a hang. `jaxserve generate` in two
processes runs a batch of prompts (several rows, chunked prefill, async overlap) in lockstep to the same tokens.
"""

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import load_config
from tests.live_server import ROOT, TINY_CONFIG, LiveServer, _wait_until_ready, free_port

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
# Longer than a step's 16 tokens, so prompts are chunked and share steps with other rows.
BATCH_PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a king who had three "
                 "daughters and a very old dog", "1 2 3 4 5 6 7 8 9 10 11 12", "Hi"]
MAX_TOKENS = 12
# Small buckets (9 programs) keep each process's start-up compiles short.
ENGINE_FLAGS = {"max_num_seqs": 2, "max_num_batched_tokens": 16}
HEARTBEAT_TIMEOUT_S = 5
# A dead peer is noticed within the heartbeat timeout; the rest is slack for a loaded machine.
EXIT_BOUND_S = 60


GROUP_ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONUNBUFFERED": "1"}


def _group_command(command: list[str], coordinator_port: int, process_id: int) -> list[str]:
    """`jaxserve COMMAND` as process `process_id` of two, over a tensor-parallel mesh of 4 spanning both."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_FLAGS.items()]
    return [sys.executable, "-m", "jaxserve.cli", *command, "--config", str(TINY_CONFIG), *flags,
            "--tensor-parallel-size", "4", "--coordinator", f"127.0.0.1:{coordinator_port}", "--num-processes", "2",
            "--process-id", str(process_id), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]


@contextlib.contextmanager
def two_process_server(tmp_dir: Path) -> Iterator[tuple[LiveServer, subprocess.Popen]]:
    """Process 0 (serving) and process 1 (following); both are killed when the block ends, whatever happened."""
    coordinator_port, port = free_port(), free_port()
    processes = []
    for process_id in (0, 1):
        with open(tmp_dir / f"process-{process_id}.log", "wb") as log:
            command = _group_command(["serve", "--port", str(port)], coordinator_port, process_id)
            processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                              env=GROUP_ENV))
    leader = LiveServer(f"http://127.0.0.1:{port}", processes[0], tmp_dir / "process-0.log")
    try:
        _wait_until_ready(leader)
        yield leader, processes[1]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def single_process_llm() -> LLM:
    """The single-process offline engine (TP 1) with the group's settings."""
    return LLM.from_config(load_config(TINY_CONFIG, ENGINE_FLAGS), use_tqdm_on_load=False)


def _greedy_texts(llm: LLM, prompts: list[str]) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [output.outputs[0].text for output in outputs]


@pytest.fixture(scope="module")
def expected_text(single_process_llm) -> str:
    return _greedy_texts(single_process_llm, [PROMPT])[0]


def test_generate_in_two_processes_gives_the_single_process_tokens(tmp_path, single_process_llm):
    coordinator_port = free_port()
    prompt_flags = [flag for prompt in BATCH_PROMPTS for flag in ("--prompt", prompt)]
    command = ["generate", *prompt_flags, "--max-tokens", str(MAX_TOKENS)]
    processes = [subprocess.Popen(_group_command(command, coordinator_port, process_id), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, cwd=ROOT, env=GROUP_ENV, text=True)
                 for process_id in (0, 1)]
    try:
        outputs = [process.communicate(timeout=300)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    printed = [line for line in outputs[0].splitlines() if " -> " in line]
    assert len(printed) == len(BATCH_PROMPTS), outputs[0][-3000:]
    for line, prompt, text in zip(printed, BATCH_PROMPTS, _greedy_texts(single_process_llm, BATCH_PROMPTS)):
        assert line.startswith(f"{prompt!r} -> {text!r}  ["), line
    assert not any(" -> " in line for line in outputs[1].splitlines())  # only process 0 prints


def _wait_for_exit(process: subprocess.Popen, log_path: Path) -> tuple[int, float]:
    """The exit code and the seconds it took; AssertionError (with the log) past EXIT_BOUND_S."""
    started = time.monotonic()
    try:
        code = process.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {EXIT_BOUND_S} s after its peer ended:\n"
                             f"{log_path.read_text(errors='replace')[-4000:]}") from None
    return code, time.monotonic() - started


def test_two_processes_serve_the_single_process_tokens_and_end_together(tmp_path, expected_text):
    with two_process_server(tmp_path) as (leader, follower):
        response = httpx.post(leader.base_url + "/v1/completions", timeout=120, json={
            "model": "jaxserve-builtin", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected_text
        assert "following the steps of process 0" in (tmp_path / "process-1.log").read_text()

        follower.kill()
        code, seconds = _wait_for_exit(leader.process, leader.log_path)
        print(f"process 0 ended {seconds:.1f} s after process 1 was killed, exit code {code}")
        assert code != 0
        assert "another task died" in leader.log() or "process of the group failed" in leader.log()


def test_killing_process_0_ends_process_1(tmp_path):
    with two_process_server(tmp_path) as (leader, follower):
        leader.process.kill()
        code, seconds = _wait_for_exit(follower, tmp_path / "process-1.log")
        print(f"process 1 ended {seconds:.1f} s after process 0 was killed, exit code {code}")
        assert code != 0
        follower_log = (tmp_path / "process-1.log").read_text(errors="replace")
        assert "another task died" in follower_log or "process of the group failed" in follower_log


def test_sigterm_to_process_0_stops_both_cleanly(tmp_path):
    with two_process_server(tmp_path) as (leader, follower):
        assert leader.terminate(timeout=EXIT_BOUND_S) == 0
        code, _ = _wait_for_exit(follower, tmp_path / "process-1.log")
        assert code == 0
        assert "process 0 released its followers" in (tmp_path / "process-1.log").read_text()
