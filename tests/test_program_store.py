"""The program store (runner/program_store.py): a start whose keys match loads every step program whole (nothing
traced, lowered or compiled) and steps exactly as a compiled one; a corrupt, truncated, stale or mismatched entry is
logged once and compiled again; a changed source tree or program-shaping setting misses the store, a setting that
shapes no program hits it; `jaxserve compile --target cpu --out DIR` fills a store a start then loads, and
`--target h100` one on this machine without a GPU; a program JAX's persistent cache hands back is never stored (it
would not run once read back), checked across fresh processes sharing a cache folder.

One engine shape throughout (the built-in model, one sequence of 8 tokens per step: 7 programs); programs rebuilt
after the first compile come back from JAX's persistent compilation cache, so each rebuild costs a lowering.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import plan_model
from jaxserve.config import EngineConfig
from jaxserve.engine.startup import PROGRAMS_FOLDER, open_program_store, program_store_dir
from jaxserve.gpu_programs.target import CUDA_PLUGIN_MISSING, cuda_plugin_installed
from jaxserve.runner import program_keys
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.program_keys import StoreScope, program_key
from jaxserve.runner.program_store import ENTRY_SUFFIX, MAGIC, SCOPE_FILE, ProgramStore, StoredPool
from jaxserve.runner.step_programs import ProgramSources

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=8, block_size=8,
              num_kv_pages=8)
PROMPTS = [[5, 9, 17, 3, 44, 7, 80, 12, 19, 2, 31], [11, 4]]  # the first takes two chunks of 8 tokens
PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1),  # the scoring program
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, presence_penalty=0.5, logprobs=2)]


def _generated(llm: LLM) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A store filled by a first start, and what that start's engine generated."""
    folder = tmp_path_factory.mktemp("store")
    llm = LLM(model=None, compiled_dir=folder, use_tqdm_on_load=False, **ENGINE)
    assert llm.engine.startup_stats.sources.store == 0
    return folder, _generated(llm), llm.engine.runner.programs.count


@pytest.fixture
def store(filled, tmp_path) -> Path:
    """A copy of the filled store, for a test to damage."""
    return Path(shutil.copytree(filled[0], tmp_path / "store"))


def _warm_up(folder: Path, **settings) -> ModelRunner:
    """A runner of the engine's shape (abstract weights: nothing read) made ready from the store at `folder`."""
    plan = plan_model(None, "float32")
    config = EngineConfig(**{**ENGINE, **settings}, compiled_dir=str(folder)).with_model_limit(
        plan.config.max_position_embeddings)
    runner = ModelRunner(plan.config, plan.graphdef, plan.abstract_params, plan.dtype, config)
    runner.warm_up(config.num_kv_pages, progress=False, store=open_program_store(config, runner))
    return runner


def _entry(folder: Path, name: str) -> Path:
    (path,) = folder.glob(f"*/{name}-{'?' * 32}{ENTRY_SUFFIX}")  # the name, then the key
    return path


def _rebuilt(runner: ModelRunner) -> int:
    sources = runner.programs.stats.sources
    return sources.cache + sources.compiled


def test_a_start_from_the_store_traces_lowers_and_compiles_nothing_and_generates_the_same(filled, store, caplog):
    _, generated, count = filled
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.startup"):
        llm = LLM(model=None, compiled_dir=store, use_tqdm_on_load=False, **ENGINE)
    stats = llm.engine.startup_stats
    assert stats.sources == ProgramSources(store=count) and stats.programs == count
    assert stats.lower_seconds == 0 and llm.engine.runner.guard.total_compiles == 0
    assert f"{count} from the store" in caplog.text  # the ready line says where the programs came from
    assert _generated(llm) == generated  # plain, penalties and scoring programs, with logprobs


def test_a_corrupt_entry_is_logged_once_compiled_again_and_rewritten(store, caplog):
    path = _entry(store, "step-T1-S1")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        runner = _warm_up(store)
    assert _rebuilt(runner) == 1 and runner.programs.stats.sources.store == runner.programs.count - 1
    assert [r.message for r in caplog.records if path.name in r.message] == [
        f"compiled program {path.name} is unusable (EntryError: corrupt: its checksum does not match); "
        "compiling it again"]
    assert _rebuilt(_warm_up(store)) == 0  # rewritten whole


def test_a_truncated_entry_is_compiled_again(store, caplog):
    path = _entry(store, "sampler-T1-S1")
    path.write_bytes(path.read_bytes()[:-1000])
    with caplog.at_level(logging.WARNING):
        assert _rebuilt(_warm_up(store)) == 1
    assert "truncated" in caplog.text


def test_an_entry_of_another_key_is_stale(store, caplog):
    shutil.copyfile(_entry(store, "step-T1-S1-penalties"), _entry(store, "step-T1-S1"))
    with caplog.at_level(logging.WARNING):
        assert _rebuilt(_warm_up(store)) == 1
    assert "stale" in caplog.text


def test_a_sound_entry_holding_another_program_is_never_run(store, caplog):
    """The last guard: an entry whose header and checksum are right but whose program takes other arguments than its
    key's (a key that missed something) is refused and compiled."""
    wrong, right = _entry(store, "sampler-T1-S1"), _entry(store, "step-T1-S1")
    key = right.stem.rpartition("-")[2]
    data = wrong.read_bytes()
    start = len(MAGIC) + 4
    header_length = int.from_bytes(data[len(MAGIC):start], "big")
    header = json.loads(data[start:start + header_length])
    header = json.dumps({**header, "key": key}).encode()
    right.write_bytes(MAGIC + len(header).to_bytes(4, "big") + header + data[start + header_length:])
    with caplog.at_level(logging.WARNING):
        assert _rebuilt(_warm_up(store)) == 1
    assert "takes other arguments than its key says" in caplog.text


def test_a_changed_source_tree_misses_the_store_and_says_why(store, monkeypatch, caplog):
    monkeypatch.setattr(program_keys, "source_hash", lambda: "another source tree")
    plan = plan_model(None, "float32")
    config = EngineConfig(**ENGINE, compiled_dir=str(store)).with_model_limit(plan.config.max_position_embeddings)
    runner = ModelRunner(plan.config, plan.graphdef, plan.abstract_params, plan.dtype, config)
    opened = open_program_store(config, runner)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.program_store"):
        for program in runner.programs.lowerings(config.num_kv_pages):  # each is then compiled, as any missing one
            call = program.call()
            key = program_key(opened.scope, call.signature(), program.compiler_options)
            assert opened.load(program.stored_name, key, call) is None
    assert caplog.text.count("the nearest differs in sources") == 1


def test_only_the_newest_builds_of_a_changed_source_tree_are_kept(store):
    """A new scope removes the scopes that differ from it in their sources alone, but the newest (KEPT_BUILDS)."""
    (scope_file,) = store.glob(f"*/{SCOPE_FILE}")
    described = json.loads(scope_file.read_text())
    for name, changes in (("older", {"sources": "a"}), ("other-model", {"sources": "b", "model": "another"})):
        (store / name).mkdir()
        (store / name / SCOPE_FILE).write_text(json.dumps({**described, **changes}))
    os.utime(store / "older" / SCOPE_FILE, (0, 0))
    newest = ProgramStore(store, StoreScope({**described, "sources": "newest"}), [])
    newest.record_pool(StoredPool(8, 0))  # its first write makes the scope's folder
    kept = {path.parent.name for path in store.glob(f"*/{SCOPE_FILE}")}
    assert kept == {newest.folder.name, scope_file.parent.name, "other-model"}


def _keys(**settings) -> dict[str, str]:
    plan = plan_model(None, "float32")
    config = EngineConfig(**{**ENGINE, **settings}).with_model_limit(plan.config.max_position_embeddings)
    runner = ModelRunner(plan.config, plan.graphdef, plan.abstract_params, plan.dtype, config)
    scope = runner.store_scope()
    return {program.stored_name: program_key(scope, program.call().signature(), program.compiler_options)
            for program in runner.programs.lowerings(config.num_kv_pages)}


TOP_LOGPROBS = {"step-T1-S1-penalties", "step-T16-S1-penalties", "step-T16-S1-prompt_logits-penalties",
                "sampler-T1-S1", "sampler-T1-S1-untruncated"}  # the programs that compute top logprobs (a plain
# bucket's forward program does not)
STEPS = {"step-T1-S1", "step-T16-S1", "step-T1-S1-penalties", "step-T16-S1-penalties",
         "step-T16-S1-prompt_logits-penalties"}  # those taking the pool and block tables (samplers take logits)


@pytest.mark.parametrize("settings, changed", [
    ({"seed": 7, "scheduling_policy": "priority", "enable_prefix_caching": False, "max_n": 4}, set()),
    ({"max_logprobs": 5}, TOP_LOGPROBS),
    ({"max_model_len": 64}, STEPS),  # the block tables' width
    ({"num_kv_pages": 9}, STEPS),  # the pool's shape
    ({"kv_cache_dtype": "fp8"}, STEPS),
    ({"max_num_batched_tokens": 32}, set()),  # new mixed buckets (T32) beside the same programs
], ids=["host-only", "max_logprobs", "max_model_len", "num_kv_pages", "kv_cache_dtype", "batched_tokens"])
def test_program_keys_follow_what_shapes_each_program(settings, changed):
    base, other = _keys(), _keys(**settings)
    assert set(base) <= set(other) and {name for name in base if base[name] != other[name]} == changed


def test_a_changed_setting_rebuilds_the_programs_it_shapes_and_loads_the_rest(store):
    runner = _warm_up(store, max_logprobs=5)
    sources = runner.programs.stats.sources
    assert sources.store > 0 and _rebuilt(runner) > 0 and runner.guard.compiles_after_warmup == 0


def test_the_store_defaults_to_the_compilation_cache_folder(tmp_path):
    assert program_store_dir(EngineConfig(compilation_cache_dir=str(tmp_path))) == tmp_path / PROGRAMS_FOLDER
    assert program_store_dir(EngineConfig(compilation_cache_dir=None)) is None
    assert program_store_dir(EngineConfig(compilation_cache_dir=None, compiled_dir=tmp_path)) == tmp_path


def test_jaxserve_compile_for_the_cpu_fills_a_store_a_start_loads_without_compiling(tmp_path):
    out = tmp_path / "compiled"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE.items()]
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "compile", "--target", "cpu", "--config",
                           str(REPO / "configs" / "tiny-cpu.yaml"), *flags, "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runner = _warm_up(out)
    assert runner.programs.stats.sources.store == runner.programs.count and runner.guard.total_compiles == 0


@pytest.mark.skipif(not cuda_plugin_installed(), reason=CUDA_PLUGIN_MISSING)
def test_jaxserve_compile_for_an_h100_fills_a_store_on_a_machine_without_a_gpu(tmp_path):
    """XLA:GPU's deviceless programs serialize whole, under the scope a start on an H100 computes (that they load
    and run there is for a GPU run to check)."""
    out = tmp_path / "compiled"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE.items() if name != "dtype"]
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "compile", "--target", "h100", "--config",
                           str(REPO / "configs" / "tiny-cpu.yaml"), "--model-shape", "tiny", *flags, "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (scope_file,) = out.glob(f"*/{SCOPE_FILE}")
    devices = json.loads(scope_file.read_text())["devices"]
    assert devices["platform"] == "gpu" and devices["kinds"] == ["NVIDIA H100 80GB HBM3"]
    assert len(list(scope_file.parent.glob(f"*{ENTRY_SUFFIX}"))) == 7 and (scope_file.parent / "pool-8.json").is_file()
    assert "7 programs in" in done.stdout and "(7 compiled)" in done.stdout


def _probe(cache: Path, batched_tokens: int, *store: str) -> dict:
    """A start in a fresh process (tests/program_store_probe.py): where its programs came from, what it generated."""
    done = subprocess.run([sys.executable, "-m", "tests.program_store_probe", str(cache), str(batched_tokens), *store],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_programs_the_compilation_cache_hands_back_are_never_stored(tmp_path):
    """The default store, beside JAX's persistent cache, keeps only the programs XLA compiled in that start: one the
    cache hands back serializes without its machine code on XLA:CPU, and a start that loaded it would fail as it runs
    ("Function wrapped_iota not found"). A first start fills the cache alone; a second, with more buckets, finds the
    first's programs there and compiles the new ones; a third loads those from the store, the rest from the cache,
    and generates what the second did."""
    cache = tmp_path / "xla"
    first = _probe(cache, 8, "none")["sources"]
    second = _probe(cache, 32)
    stored = len(list((cache / PROGRAMS_FOLDER).glob(f"*/*{ENTRY_SUFFIX}")))
    third = _probe(cache, 32)  # runs every program it loaded
    assert second["sources"]["cache"] == first["compiled"] and second["sources"]["compiled"] == stored > 0
    assert third["sources"] == {"store": second["sources"]["compiled"], "cache": first["compiled"], "compiled": 0}
    assert third["tokens"] == second["tokens"]
