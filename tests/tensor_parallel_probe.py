"""Tensor-parallel checks on 8 simulated CPU devices, printed as one JSON object on stdout's last line.

Run by tests/test_tensor_parallel.py in a subprocess, because XLA_FLAGS must give 8 host devices before JAX starts
(and the rest of the suite runs on one). Usage: python -m tests.tensor_parallel_probe WORK_DIR (from the repository root)
"""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from jaxserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR, convert_hf_to_orbax, load_model, shard_placement  # noqa: E402
from jaxserve.checkpoint.param_tree import checkpoint_tensors, flat_arrays  # noqa: E402
from jaxserve.model.param_names import is_stacked  # noqa: E402
from jaxserve.parallel import TP_AXIS, param_partition_spec, plan_tensor_parallel  # noqa: E402
from jaxserve.parallel.collectives import all_gather_shapes, count_collectives  # noqa: E402
from tests.hf_models import write_tiny_checkpoint  # noqa: E402
from tests.test_engine import RandomDrafts, _workload  # noqa: E402

TP_SIZES = (1, 2, 4, 8)
# The Pallas kernel (through Pallas' interpreter) inside shard_map: plain split, and one repeated KV head per device.
PALLAS_TP_SIZES = (2, 8)
# 8 query heads so every size divides them; 2 KV heads so sizes 4 and 8 repeat KV heads at load time.
MODEL = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
# int8 weights with their scales: a plain split, and KV heads (their scales too) repeated at load time.
INT8_TP_SIZES = (1, 4)
# A float8 KV pool split over KV heads (one repeated head per device at 4), its per-layer scales replicated.
FP8_KV_TP_SIZES = (1, 4)
# Drafts verified over a split vocabulary (logits gathered for K + 1 rows per sequence).
SPECULATIVE_TP_SIZES = (4,)
# Small buckets (7 programs) keep four engines' start-up compiles within the test's budget.
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, block_size=8,
              num_kv_pages=24, use_tqdm_on_load=False)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    prompts, params = _workload(seed=5, count=6)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


# Constrained greedy draws: each step's masks reach the sampler program, replicated over the mesh.
CONSTRAINED_PROMPTS = ["Code:", "Another code:"]
CONSTRAINT = r"[a-c]{3}-\d{2}"


def constrained_outputs(llm: LLM) -> list[str]:
    params = SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(regex=CONSTRAINT))
    return [o.outputs[0].text for o in llm.generate(CONSTRAINED_PROMPTS, params, use_tqdm=False)]


def pallas_report(model_dir: Path, tp: int) -> dict:
    llm = LLM(model=str(model_dir), tokenizer=str(BUILTIN_MODEL_DIR), tensor_parallel_size=tp,
              attention_backend="pallas", pallas_interpret=True, **ENGINE)
    return dict(tokens=greedy_tokens(llm), compiles_after_warmup=llm.engine.compiles_after_warmup)


def speculative_report(model_dir: Path, tp: int) -> dict:
    """Greedy tokens with drafts verified under tensor parallelism: random drafts, so rollback runs nearly always."""
    llm = LLM(model=str(model_dir), tokenizer=str(BUILTIN_MODEL_DIR), tensor_parallel_size=tp,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **ENGINE)
    llm.engine.scheduler.proposer = RandomDrafts(seed=0)
    tokens = greedy_tokens(llm)
    return dict(tokens=tokens, compiles_after_warmup=llm.engine.compiles_after_warmup,
                num_draft_tokens=llm.engine.stats().spec_decode.num_draft_tokens)


def draft_model_report(model_dir: Path, draft_dir: Path, tp: int) -> dict:
    """Greedy tokens with a draft model of its own, split over the same devices as the target."""
    llm = LLM(model=str(model_dir), tokenizer=str(BUILTIN_MODEL_DIR), tensor_parallel_size=tp,
              speculative_config={"model": str(draft_dir), "num_speculative_tokens": 3}, **ENGINE)
    tokens = greedy_tokens(llm)
    return dict(tokens=tokens, compiles_after_warmup=llm.engine.compiles_after_warmup,
                num_draft_tokens=llm.engine.stats().spec_decode.num_draft_tokens,
                draft_pool_shard_shape=list(llm.engine.draft_runner.pool.k_pages.addressable_shards[0].data.shape))


def engine_report(model_dir: Path, tp: int, quantization: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    llm = LLM(model=str(model_dir), tokenizer=str(BUILTIN_MODEL_DIR), tensor_parallel_size=tp,
              quantization=quantization, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    tokens = greedy_tokens(llm)
    constrained = constrained_outputs(llm)
    runner = llm.engine.runner
    arrays = flat_arrays(llm.engine.runner.params)
    greedy_program = runner.programs.step(runner.buckets.select(16, 2))
    return dict(
        tokens=tokens,
        constrained=constrained,
        compiles_after_warmup=llm.engine.compiles_after_warmup,
        kv_heads=llm.model.config.num_key_value_heads,
        wrong_shardings=[name for name, array in arrays.items() if not _sharded_as_ruled(name, array, tp)],
        device_bytes=sorted({_device_bytes(arrays, device) for device in runner.mesh.devices.flat}),
        expected_device_bytes=sum(_expected_share(name, array, tp) for name, array in arrays.items()),
        pool_shard_shape=list(runner.pool.k_pages.addressable_shards[0].data.shape),
        pool_dtype=runner.pool.k_pages.dtype.name,
        collectives=count_collectives(greedy_program.as_text()),
        all_gather_shapes=all_gather_shapes(greedy_program.as_text()),
    )


def _sharded_as_ruled(name: str, array, tp: int) -> bool:
    return array.sharding.mesh.shape[TP_AXIS] == tp and tuple(array.sharding.spec) == tuple(_rule(name, array))


def _rule(name: str, array):
    """The rule's partition of a parameter, given its rank (scales of a block-quantized weight are 2-D)."""
    return param_partition_spec(name, array.ndim - is_stacked(name))


def _device_bytes(arrays: dict, device) -> int:
    return sum(shard.data.nbytes for array in arrays.values() for shard in array.addressable_shards
               if shard.device == device)


def _expected_share(name: str, array, tp: int) -> int:
    """The rule's share of one tensor on one device: 1/tp of a split tensor, all of a replicated one."""
    split = any(axis is not None for axis in _rule(name, array))
    return array.nbytes // tp if split else array.nbytes


def orbax_matches_safetensors(model_dir: Path, orbax_model_dir: Path, tp: int) -> bool:
    """Both formats give the same sharded arrays (KV heads repeated as well)."""
    convert_hf_to_orbax(model_dir, orbax_model_dir, progress=False)
    from_safetensors = flat_arrays(load_model(model_dir, "float32", False, tensor_parallel_size=tp).params)
    from_orbax = flat_arrays(load_model(orbax_model_dir, "float32", False, tensor_parallel_size=tp).params)
    return all(from_orbax[name].sharding == array.sharding and np.array_equal(from_orbax[name], array)
               for name, array in from_safetensors.items())


def shard_reads(model_dir: Path, tp: int) -> dict:
    """Host reads while loading, against the distinct device slices (per layer for a stacked parameter): a replicated
    tensor is read once, not tp times."""
    reads = []
    real_read = shard_placement.read_shard

    def counting_read(source, index, stored_rows):
        reads.append(index)
        return real_read(source, index, stored_rows)

    shard_placement.read_shard = counting_read
    try:
        arrays = flat_arrays(load_model(model_dir, "float32", False, tensor_parallel_size=tp).params)
    finally:
        shard_placement.read_shard = real_read
    # A stacked parameter's device slice is read layer by layer: one read per layer of each distinct slice.
    distinct = sum(len({shard.index for shard in array.addressable_shards}) * (array.shape[0] if is_stacked(name) else 1)
                   for name, array in arrays.items())
    return dict(reads=len(reads), distinct_slices=distinct)


def builtin_matches_single_device(tp: int) -> bool:
    """The built-in model drawn sharded equals the one-device draw, KV rows repeated as the layout says."""
    single = load_model(None, "float32", False)
    split = load_model(None, "float32", False, tensor_parallel_size=tp)
    layout = plan_tensor_parallel(single.config, tp)
    single_arrays, split_arrays = (checkpoint_tensors(flat_arrays(single.params)),
                                   checkpoint_tensors(flat_arrays(split.params)))
    for name, array in split_arrays.items():
        rows = layout.stored_rows(name)
        expected = np.asarray(single_arrays[name])
        if not np.array_equal(np.asarray(array), expected if rows is None else expected[rows]):
            return False
    return True


def draft_dir(work_dir: Path) -> Path:
    """Another random model of the same shapes, with the tokenizer files a draft's folder carries."""
    folder = work_dir / "draft"
    write_tiny_checkpoint(folder, seed=1, **MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, folder / name)
    return folder


def main(work_dir: Path) -> None:
    model_dir = work_dir / "hf"
    write_tiny_checkpoint(model_dir, **MODEL)
    report = {"engines": {tp: engine_report(model_dir, tp) for tp in TP_SIZES},
              "pallas_engines": {tp: pallas_report(model_dir, tp) for tp in PALLAS_TP_SIZES},
              "int8_engines": {tp: engine_report(model_dir, tp, "int8") for tp in INT8_TP_SIZES},
              "fp8_kv_engines": {tp: engine_report(model_dir, tp, kv_cache_dtype="fp8") for tp in FP8_KV_TP_SIZES},
              "speculative_engines": {tp: speculative_report(model_dir, tp) for tp in SPECULATIVE_TP_SIZES},
              "draft_model_engines": {tp: draft_model_report(model_dir, draft_dir(work_dir), tp)
                                      for tp in SPECULATIVE_TP_SIZES},
              "orbax_matches_safetensors": orbax_matches_safetensors(model_dir, work_dir / "orbax", tp=4),
              "builtin_matches_single_device": builtin_matches_single_device(tp=4),
              "shard_reads": shard_reads(model_dir, tp=8),
              "constraint": CONSTRAINT}
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
