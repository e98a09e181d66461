"""Schemathesis fuzzes the live server from its own /openapi.json: no answer is a 5xx, every answer (streamed
events included) matches the document, and requests in flight meanwhile complete exactly as they do alone."""

import subprocess
import sys

import httpx
import pytest

from tests.live_server import completions_meanwhile, running_server

pytestmark = pytest.mark.slow

API_KEY = "sk-fuzz-51c2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 96  # short defaults for chat (it fills the context when max_tokens is left out) keep the run quick
GREEDY = {"prompt": "The fuzzer", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
# Not run: whether a schema-valid request is accepted also depends on the tokenizer (ids outside the vocabulary,
# prompts past the context) and on rules between fields (top_logprobs needs logprobs), which the schema does not
# state; the hand-written tables of tests/test_server_errors.py hold those 400s to their messages.
EXCLUDED_CHECKS = "positive_data_acceptance"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("fuzz"), "--api-key", API_KEY,
                        "--max-model-len", str(MAX_MODEL_LEN)) as live:
        yield live


def _schemathesis(server, work_dir) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "schemathesis.cli", "run", server.base_url + "/openapi.json",
               "--header", f"Authorization: Bearer {API_KEY}", "--checks", "all",
               "--exclude-checks", EXCLUDED_CHECKS, "--max-examples", "8", "--seed", "20261125",
               "--workers", "2", "--generation-database", "none", "--no-color"]
    return subprocess.run(command, cwd=work_dir, capture_output=True, text=True, timeout=600)


def test_fuzzing_the_declared_schemas_finds_no_violation(server, tmp_path):
    solo = httpx.post(server.base_url + "/v1/completions", json=GREEDY, headers=AUTH, timeout=120).json()
    with completions_meanwhile(server.base_url, GREEDY, AUTH) as meanwhile:
        run = _schemathesis(server, tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and "generated" in run.stdout, run.stdout[-2000:]
    assert len(meanwhile) > 1 and all(answer["choices"] == solo["choices"] for answer in meanwhile)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert "Traceback" not in server.log()
