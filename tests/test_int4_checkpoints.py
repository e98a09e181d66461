"""4-bit (W4A16) checkpoints loaded as they are (jaxserve/checkpoint/int4_checkpoint.py): compressed-tensors
pack-quantized, per group and per channel, symmetric and asymmetric, written by compressed-tensors itself
(tests/int4_checkpoints.py).

The logits equal transformers reading the same files dequantized, and jaxserve's unquantized model on the
dequantized weights; a wrong nibble order or an off-by-one zero point would move them far beyond the tolerance (a
test shows by how much); the engine decodes transformers' greedy tokens. Every scheme jaxserve does not run and every
damaged checkpoint is refused, naming the setting or the tensor. Tensor parallelism (groups split with their rows
and columns, never across devices) runs in tests/quantized_checkpoint_probe.py.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR, load_model, plan_model
from jaxserve.checkpoint.int4_layout import AWQ_ORDER, unpack_int4
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.checkpoint.quantize import dequantized_arrays
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxserve.model.quantization import PACKED_INT4
from tests.hf_models import edit_config, hf_logits, jaxserve_logits, random_tokens

# name -> (writer arguments, the format jaxserve reports running)
CHECKPOINTS = {
    "group-sym": (dict(group_size=32, symmetric=True),
                  "int4 (compressed-tensors pack-quantized W4A16, group 32, symmetric)"),
    "group-asym": (dict(group_size=32, symmetric=False),
                   "int4 (compressed-tensors pack-quantized W4A16, group 32, asymmetric, zero points)"),
    "channel-sym": (dict(group_size=None, symmetric=True),
                    "int4 (compressed-tensors pack-quantized W4A16, per-channel, symmetric)"),
    "channel-asym": (dict(group_size=None, symmetric=False),
                     "int4 (compressed-tensors pack-quantized W4A16, per-channel, asymmetric, zero points)"),
}
# float32 logits, transformers against jaxserve: 3.6e-5 the most seen
TOLERANCE = 1e-4
ENGINE = dict(tokenizer=str(BUILTIN_MODEL_DIR), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=8, num_kv_pages=24, use_tqdm_on_load=False)
PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 200], [1, 9, 9, 9, 250, 251, 3]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each variant's checkpoint of one tiny HF Llama whose projections' block magnitudes vary."""
    for module in ("torch", "transformers", "compressed_tensors"):
        pytest.importorskip(module)
    from tests.fp8_checkpoints import vary_block_magnitudes
    from tests.hf_models import build_tiny_hf_llama
    from tests.int4_checkpoints import save_compressed_tensors_w4a16

    model = vary_block_magnitudes(build_tiny_hf_llama("llama31", vocab_size=512))
    folders = {}
    for name, (arguments, _) in CHECKPOINTS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        save_compressed_tensors_w4a16(model, folders[name], **arguments)
    return folders


def _oracle_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    from tests.fp8_checkpoints import transformers_dequantized

    return hf_logits(transformers_dequantized(folder), tokens)


def _dense(loaded, arrays: dict | None = None):
    """`loaded` as an unquantized model running the weights its 4-bit projections stand for (from `arrays`, its
    own flat arrays by default)."""
    layout = abstract_params(loaded.config, np.dtype(np.float32), lambda name, shape: None)
    in_features = {name: spec.shape[-1] for name, spec in layout.specs.items()}
    dense = dequantized_arrays(arrays or flat_arrays(loaded.params), jnp.float32, _format(loaded).block, in_features)
    return dataclasses.replace(loaded, graphdef=layout.graphdef, params=fill_params(layout, dense), quantization=None)


def _format(loaded):
    from flax import nnx

    from jaxserve.model.llama import projection_format

    return projection_format(nnx.merge(loaded.graphdef, loaded.params))


@pytest.mark.parity
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_equal_transformers_reading_the_checkpoint_and_the_dequantized_reference(checkpoints, name):
    loaded = load_model(checkpoints[name], "float32", progress=False)
    assert loaded.quantization == CHECKPOINTS[name][1]
    arrays = flat_arrays(loaded.params)
    assert arrays["model.layers.mlp.down_proj.weight"].dtype == PACKED_INT4  # two 4-bit weights a byte
    assert ("model.layers.mlp.down_proj.weight_zero_point" in arrays) == name.endswith("asym")
    tokens = random_tokens(loaded.config.vocab_size, 24)
    logits = jaxserve_logits(loaded, tokens)
    np.testing.assert_allclose(logits, _oracle_logits(checkpoints[name], tokens), atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(logits, jaxserve_logits(_dense(loaded), tokens), atol=TOLERANCE, rtol=0)


def _reversed_nibbles(q):
    """Each byte's two values swapped: what reading the high nibble first would give."""
    values = np.asarray(q, np.uint8)
    return jnp.asarray((values >> 4) | (values << 4), jnp.uint8)


MISREAD = {
    "nibbles reversed": lambda arrays, name: {**arrays, name: _reversed_nibbles(arrays[name])},
    "zero point off by one": lambda arrays, name: {**arrays, name + "_zero_point": arrays[name + "_zero_point"] + 1},
}


@pytest.mark.parity
@pytest.mark.parametrize("mistake", MISREAD)
def test_a_misread_nibble_order_or_zero_point_would_move_the_logits_far_beyond_the_tolerance(checkpoints, mistake):
    loaded = load_model(checkpoints["group-asym"], "float32", progress=False)
    tokens = random_tokens(loaded.config.vocab_size, 24)
    arrays = flat_arrays(loaded.params)
    for name in ("model.layers.self_attn.q_proj.weight", "model.layers.mlp.down_proj.weight"):
        arrays = MISREAD[mistake](arrays, name)
    wrong = jaxserve_logits(_dense(loaded, arrays), tokens)
    assert np.abs(wrong - _oracle_logits(checkpoints["group-asym"], tokens)).max() > 100 * TOLERANCE


@pytest.mark.parity
def test_the_engine_decodes_transformers_greedy_tokens(checkpoints):
    import torch

    from tests.fp8_checkpoints import transformers_dequantized

    llm = LLM(model=str(checkpoints["group-asym"]), **ENGINE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    oracle = transformers_dequantized(checkpoints["group-asym"])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = oracle.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected


def test_the_models_packing_holds_two_values_a_byte_each_block_in_two_halves():
    from jaxserve.model.quantization import pack_int4, packed_width, unpack_int4 as unpack_packed

    values = np.random.default_rng(0).integers(-8, 8, size=(3, 100)).astype(np.int8)  # 100: a partial last block
    packed = pack_int4(values)
    assert packed.shape == (3, packed_width(100)) == (3, 64) and packed.dtype == np.uint8
    assert packed[0, 0] == (values[0, 0] + 8) | ((values[0, 32] + 8) << 4)  # feature 0 low, feature 32 high
    np.testing.assert_array_equal(unpack_packed(jnp.asarray(packed), 100), values)


def _calls_the_int4_kernel(llm: LLM) -> bool:
    """Every step program of the engine calls kernels_pallas/int4_matmul.py (its traced jaxpr names it)."""
    found = []
    for program in llm.engine.runner.programs.lowerings(llm.engine.config.num_kv_pages):
        if not program.sampler:
            call = program.call()
            found.append("name=int4_matmul" in str(call.function.trace(*call.args, **call.static).jaxpr))
    return all(found)


@pytest.mark.parity
@pytest.mark.parametrize("layout", ["compressed-tensors", "gptq act-order"])
def test_the_pallas_w4a16_kernel_decodes_what_the_reference_path_decodes(tmp_path, layout):
    """Groups of 64 (the kernel's packed block) with zero points, and an act-order GPTQ checkpoint's permuted
    features: the engine reading the 4-bit stacks in place (--gemm-backend pallas, interpreted here; under auto on a
    GPU) gives the greedy tokens and logprobs of the reference path, which dequantizes each layer's weight for XLA's
    matmul."""
    from tests.fp8_checkpoints import vary_block_magnitudes
    from tests.hf_models import build_tiny_hf_llama
    from tests.int4_checkpoints import save_compressed_tensors_w4a16, save_gptq

    model = vary_block_magnitudes(build_tiny_hf_llama("llama31", vocab_size=512, intermediate_size=192))
    if layout == "gptq act-order":
        save_gptq(model, tmp_path, group_size=64, act_order=True)
    else:
        save_compressed_tensors_w4a16(model, tmp_path, group_size=64, symmetric=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    decoded = {}
    for name, settings in (("xla", {}), ("kernel", dict(gemm_backend="pallas", pallas_interpret=True))):
        llm = LLM(model=str(tmp_path), **ENGINE, **settings)
        assert _calls_the_int4_kernel(llm) == (name == "kernel")
        decoded[name] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for reference, kernel in zip(decoded["xla"], decoded["kernel"]):
        assert kernel.outputs[0].token_ids == reference.outputs[0].token_ids
        np.testing.assert_allclose([lp[t].logprob for t, lp in zip(kernel.outputs[0].token_ids,
                                                                   kernel.outputs[0].logprobs)],
                                   [lp[t].logprob for t, lp in zip(reference.outputs[0].token_ids,
                                                                   reference.outputs[0].logprobs)], atol=1e-4)


def test_unpacking_reads_eight_values_a_word_lowest_bits_first_or_in_awqs_interleave():
    words = np.array([[0x76543210, 0xFEDCBA98 - 2**32]], np.int64).astype(np.int32)  # one row, two words
    np.testing.assert_array_equal(unpack_int4(words, 16, axis=1), [np.arange(16)])
    np.testing.assert_array_equal(unpack_int4(words.T, 12, axis=0)[:, 0], np.arange(12))
    # AWQ: nibble i of a word holds value AWQ_ORDER[i] (0, 2, 4, 6, 1, 3, 5, 7)
    np.testing.assert_array_equal(unpack_int4(words[:, :1], 8, 1, AWQ_ORDER), [[0, 4, 1, 5, 2, 6, 3, 7]])


def _edited(folder: Path, tmp_path: Path, **weights) -> Path:
    """A copy of `folder` whose config's weights scheme has `weights` changed (None removes a key)."""
    copy = Path(shutil.copytree(folder, tmp_path / folder.name))
    config = json.loads((copy / "config.json").read_text())["quantization_config"]
    scheme = config["config_groups"]["group_0"]["weights"]
    scheme.update(weights)
    edit_config(copy, quantization_config=config)
    return copy


def _retensored(folder: Path, tmp_path: Path, change) -> Path:
    from tests.fp8_checkpoints import edit_tensors

    copy = Path(shutil.copytree(folder, tmp_path / folder.name))
    edit_tensors(copy, change)
    return copy


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _as_float(name):
    return lambda tensors: tensors.update({name: tensors[name].float()})


def _cut(name):
    return lambda tensors: tensors.update({name: tensors[name][:, :-1].contiguous()})


REFUSED_CONFIGS = {
    "8-bit weights": (dict(num_bits=8), UnsupportedModelError, r"type 'int' with num_bits 8 are not supported"),
    "float weights": (dict(type="float"), UnsupportedModelError, r"type 'float' with num_bits 4 are not supported"),
    "act-order without g_idx": (dict(actorder="group"), ModelLoadError,
                                r"lacks tensor model\.layers\.0\.mlp\.down_proj\.weight_g_idx"),
    "tensor strategy": (dict(strategy="tensor"), UnsupportedModelError, r"weight strategy 'tensor' is not supported"),
    "no group size": (dict(group_size=None), UnsupportedModelError, r"group_size must be a positive integer"),
}
DAMAGED = {
    "missing zero point": (_drop("model.layers.1.mlp.down_proj.weight_zero_point"), ModelLoadError,
                           r"lacks 1 tensor.*: model\.layers\.1\.mlp\.down_proj\.weight_zero_point$"),
    "packed weight stored as float": (_as_float("model.layers.0.self_attn.q_proj.weight_packed"), ModelLoadError,
                                      r"q_proj\.weight_packed .* has dtype float32, but the checkpoint's "
                                      r"quantization_config stores it as int32"),
    "packed weight cut short": (_cut("model.layers.0.mlp.up_proj.weight_packed"), ModelLoadError,
                                r"model\.layers\.0\.mlp\.up_proj\.weight_packed"),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", REFUSED_CONFIGS)
def test_schemes_jaxserve_does_not_run_are_refused_by_name(checkpoints, tmp_path, case):
    weights, error, message = REFUSED_CONFIGS[case]
    with pytest.raises(error, match=message):
        plan_model(_edited(checkpoints["group-asym"], tmp_path, **weights), "float32")


@pytest.mark.parity
@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_checkpoints_are_refused_naming_the_tensor(checkpoints, tmp_path, case):
    change, error, message = DAMAGED[case]
    with pytest.raises(error, match=message):
        plan_model(_retensored(checkpoints["group-asym"], tmp_path, change), "float32")


@pytest.mark.parity
def test_a_quantization_flag_contradicting_the_checkpoint_is_refused(checkpoints):
    with pytest.raises(ConfigError, match=r"--quantization int8 contradicts the checkpoint's own scheme, int4"):
        plan_model(checkpoints["group-sym"], "float32", quantization="int8")


@pytest.mark.parity
def test_an_integer_tensor_in_an_unquantized_checkpoint_is_refused(checkpoints, tmp_path):
    import torch

    from tests.fp8_checkpoints import edit_tensors

    folder = Path(shutil.copytree(checkpoints["group-sym"], tmp_path / "plain"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    edit_tensors(folder, lambda tensors: tensors.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(UnsupportedModelError, match=r"model\.norm\.weight .* has dtype int32; jaxserve loads float"):
        plan_model(folder, "float32")


@pytest.mark.parity
def test_compressed_tensors_act_order_groups_load_with_their_permutation(checkpoints, tmp_path):
    """actorder "group": each weight's columns sorted by its weight_g_idx as it loads, the activations gathered the
    same way; the logits equal transformers on the weights the checkpoint's integers stand for."""
    from tests.fp8_checkpoints import vary_block_magnitudes
    from tests.hf_models import build_tiny_hf_llama
    from tests.int4_checkpoints import save_compressed_tensors_act_order

    oracle = save_compressed_tensors_act_order(
        vary_block_magnitudes(build_tiny_hf_llama("llama31", vocab_size=512)), tmp_path, group_size=32)
    loaded = load_model(tmp_path, "float32", progress=False)
    assert loaded.quantization == ("int4 (compressed-tensors pack-quantized W4A16, group 32, asymmetric, zero points, "
                                   "act-order)")
    tokens = random_tokens(loaded.config.vocab_size, 24)
    np.testing.assert_allclose(jaxserve_logits(loaded, tokens), hf_logits(oracle, tokens), atol=TOLERANCE, rtol=0)


# AWQ and GPTQ (jaxserve/checkpoint/int4_awq_gptq.py)

GPTQ = {  # name -> (writer arguments, the format jaxserve reports running)
    "gptq-v1-asym": (dict(group_size=32, symmetric=False, v1=True),
                     "int4 (gptq v1 W4A16, group 32, asymmetric, zero points)"),
    "gptq-v2-asym": (dict(group_size=32, symmetric=False, v1=False),
                     "int4 (gptq v2 W4A16, group 32, asymmetric, zero points)"),
    "gptq-v1-sym": (dict(group_size=32, symmetric=True, v1=True), "int4 (gptq v1 W4A16, group 32, symmetric)"),
    "gptq-v1-channel": (dict(group_size=None, symmetric=False, v1=True),
                        "int4 (gptq v1 W4A16, per-channel, asymmetric, zero points)"),
    "gptq-act-order": (dict(group_size=32, symmetric=False, v1=False, act_order=True),
                       "int4 (gptq v2 W4A16, group 32, asymmetric, zero points, act-order)"),
}


@pytest.fixture(scope="module")
def awq_gptq(checkpoints, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (checkpoint folder, its oracle: a transformers model) for AWQ (float32 and float16 scales) and each
    GPTQ variant."""
    from tests.fp8_checkpoints import transformers_dequantized, vary_block_magnitudes
    from tests.hf_models import build_tiny_hf_llama
    from tests.int4_checkpoints import awq_as_compressed_tensors, save_awq, save_gptq

    model = vary_block_magnitudes(build_tiny_hf_llama("llama31", vocab_size=512))
    work = tmp_path_factory.mktemp("awq_gptq")
    made = {}
    for name, scale_dtype in (("awq", np.float32), ("awq-f16", np.float16)):
        save_awq(model, work / name, scale_dtype=scale_dtype)
        converted = awq_as_compressed_tensors(work / name, work / f"{name}-ct")
        made[name] = (work / name, transformers_dequantized(converted))
    for name, (arguments, _) in GPTQ.items():
        made[name] = (work / name, save_gptq(model, work / name, **arguments))
    return made


@pytest.mark.parity
@pytest.mark.parametrize("name", ["awq", *GPTQ])
def test_awq_and_gptq_logits_equal_their_oracles(awq_gptq, name):
    """AWQ: compressed-tensors' AutoAWQConverter reading the same files (then transformers); GPTQ: transformers on the
    weights the integers stand for. v1 checkpoints hold zero points of 0 (stored as 15 with a borrow)."""
    folder, oracle = awq_gptq[name]
    loaded = load_model(folder, "float32", progress=False)
    expected = "int4 (awq GEMM W4A16, group 32, asymmetric, zero points)" if name == "awq" else GPTQ[name][1]
    assert loaded.quantization == expected
    tokens = random_tokens(loaded.config.vocab_size, 24)
    np.testing.assert_allclose(jaxserve_logits(loaded, tokens), hf_logits(oracle, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parity
def test_awq_with_float16_scales_equals_the_conversion_within_float16_rounding(awq_gptq):
    """AutoAWQ stores float16 scales; compressed-tensors multiplies in float16 where jaxserve multiplies in float32,
    so each weight agrees within half a float16 ulp of its value."""
    folder, oracle = awq_gptq["awq-f16"]
    loaded = load_model(folder, "float32", progress=False)
    ours = np.asarray(_dense(loaded).params["model"]["layers"]["self_attn"]["q_proj"]["weight"].get_value()[0])
    theirs = oracle.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_less(np.abs(ours - theirs), 2.0**-11 * np.abs(ours) + 1e-7)


def test_gptq_v1_zero_points_are_restored_on_the_whole_word_with_its_borrows():
    from jaxserve.checkpoint.int4_awq_gptq import unpack_zero_points

    zeros = np.array([[0, 5, 15, 0, 1, 0, 8, 3]], np.uint32)  # one group of eight channels
    word = (zeros[0] << (np.arange(8, dtype=np.uint32) * 4)).sum(dtype=np.uint32)
    stored = np.array([[word - np.uint32(0x11111111)]], np.uint32).view(np.int32)  # v1: less one per nibble, borrowing
    np.testing.assert_array_equal(unpack_zero_points(stored, 8, tuple(range(8)), v1=True), zeros)
    per_nibble = (unpack_zero_points(stored, 8, tuple(range(8)), v1=False) + 1) % 16  # a reader that skips borrows
    assert not np.array_equal(per_nibble, zeros)


def _edited_gptq(folder: Path, tmp_path: Path, **fields) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / folder.name))
    config = json.loads((copy / "config.json").read_text())["quantization_config"]
    edit_config(copy, quantization_config={**config, **fields})
    return copy


def _uneven_g_idx(tensors):
    name = "model.layers.1.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].clone()
    tensors[name][:3] = 1  # group 0 short of three features, group 1 three over


REFUSED_AWQ_GPTQ = {
    "awq gemv_fast": ("awq", dict(version="gemv_fast"), r"AWQ checkpoints of version 'gemv_fast' are not supported"),
    "awq without zero points": ("awq", dict(zero_point=False), r"without zero points"),
    "gptq 8-bit": ("gptq-v1-asym", dict(bits=8), r"gptq checkpoints with bits 8 are not supported"),
    "gptq marlin": ("gptq-v1-asym", dict(checkpoint_format="marlin"), r"checkpoint_format 'marlin' is not supported"),
    "gptq dynamic": ("gptq-v1-asym", dict(dynamic={"-:.*down_proj": {}}), r"per-module overrides"),
    "gptq lm_head": ("gptq-v1-asym", dict(lm_head=True), r"quantized lm_head"),
    "gptq group size": ("gptq-v1-asym", dict(group_size=0), r"group_size must be a positive integer or -1"),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", REFUSED_AWQ_GPTQ)
def test_awq_and_gptq_schemes_jaxserve_does_not_run_are_refused_by_name(awq_gptq, tmp_path, case):
    name, fields, message = REFUSED_AWQ_GPTQ[case]
    with pytest.raises(UnsupportedModelError, match=message):
        plan_model(_edited_gptq(awq_gptq[name][0], tmp_path, **fields), "float32")


@pytest.mark.parity
def test_act_order_needs_its_permutation_and_uneven_groups_or_a_missing_g_idx_are_refused(awq_gptq, tmp_path):
    """Read without the permutation (g_idx taken as k // group_size) the act-order checkpoint's logits are far off;
    a g_idx whose groups are not all full is refused naming it."""
    folder, oracle = awq_gptq["gptq-act-order"]
    loaded = load_model(folder, "float32", progress=False)
    tokens = random_tokens(loaded.config.vocab_size, 24)
    arrays = flat_arrays(loaded.params)
    unpermuted = {name: jnp.broadcast_to(jnp.arange(array.shape[-1], dtype=jnp.int32), array.shape)
                  if name.endswith("_perm") else array for name, array in arrays.items()}
    wrong = jaxserve_logits(_dense(loaded, unpermuted), tokens)
    assert np.abs(wrong - hf_logits(oracle, tokens)).max() > 100 * TOLERANCE
    uneven = _retensored(awq_gptq["gptq-v1-asym"][0], tmp_path, _uneven_g_idx)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj\.g_idx does not give every "
                                                    r"group 32 input features"):
        plan_model(uneven, "float32")
    missing = _retensored(awq_gptq["gptq-v1-asym"][0], tmp_path / "missing",
                          _drop("model.layers.0.self_attn.o_proj.g_idx"))
    with pytest.raises(ModelLoadError, match=r"lacks tensor model\.layers\.0\.self_attn\.o_proj\.g_idx"):
        plan_model(missing, "float32")


@pytest.mark.parity
def test_an_older_gptq_repository_with_quantize_config_json_loads(awq_gptq, tmp_path):
    folder = Path(shutil.copytree(awq_gptq["gptq-v2-asym"][0], tmp_path / "older"))
    config = json.loads((folder / "config.json").read_text())
    scheme = config.pop("quantization_config")
    scheme.pop("quant_method")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quantize_config.json").write_text(json.dumps(scheme))
    assert plan_model(folder, "float32").quantization == GPTQ["gptq-v2-asym"][1]
