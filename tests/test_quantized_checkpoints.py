"""Pre-quantized FP8 checkpoints loaded as they are (jaxserve/checkpoint/quantized_checkpoint.py).

Tiny compressed-tensors checkpoints (per tensor, per channel, and per block with partial edge blocks), written by
compressed-tensors itself, and a transformers fp8 (block) checkpoint (tests/fp8_checkpoints.py) give the logits of
transformers reading the same files dequantized, and of jaxserve's unquantized model on the dequantized weights;
the engine decodes transformers' greedy tokens. The checkpoints' scales vary strongly from block to block, so a
scale transposed or applied per input channel would be caught (a test shows by how much). Every unsupported scheme
and damaged checkpoint is refused, naming the setting or the tensor. Tensor parallelism (scales split and repeated
with their weights, blocks never split) runs in tests/quantized_checkpoint_probe.py on simulated devices.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR, convert_hf_to_orbax, load_model, plan_model
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.checkpoint.quantize import dequantized_arrays
from jaxserve.checkpoint.quantized_checkpoint import checkpoint_quantization
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxserve.model.quantization import WEIGHT_FORMATS, dequantize, scaled_matmul
from tests.hf_models import edit_config, hf_logits, jaxserve_logits, random_tokens, write_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
# name -> (writer, its arguments, the format jaxserve reports running)
CHECKPOINTS = {
    "ct-tensor": ("compressed-tensors", dict(strategy="tensor", inputs="static"),
                  "fp8 (compressed-tensors, per-tensor scales; prefill W8A8, static activations)"),
    "ct-channel": ("compressed-tensors", dict(strategy="channel", inputs="dynamic"),
                   "fp8 (compressed-tensors, per-channel scales; prefill W8A8, dynamic activations)"),
    # 48x40 blocks leave partial blocks at the edge of every projection (64, 160 rows and columns).
    "ct-block": ("compressed-tensors", dict(strategy="block", block=(48, 40), inputs=None),
                 "fp8 (compressed-tensors, 48x40 block scales)"),
    "fp8-block": ("fp8", dict(block=(32, 32)), "fp8 (transformers fp8, 32x32 block scales)"),
}
# float32 logits: transformers against jaxserve (the same weights, two implementations), and jaxserve's quantized
# model against its unquantized one on the dequantized weights (the same computation, the matmul order aside: a
# per-channel scale applied after the dot rounds differently, up to 6.3e-5 seen on one x86 CPU).
ORACLE_TOLERANCE = 1e-4
REFERENCE_TOLERANCE = 1e-4
# Small step buckets keep each engine's start-up compiles short.
ENGINE = dict(tokenizer=str(BUILTIN_MODEL_DIR), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, block_size=8, num_kv_pages=24, use_tqdm_on_load=False)
PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 200], [1, 9, 9, 9, 250, 251, 3]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def parity_libraries():
    for module in ("torch", "transformers", "accelerate", "compressed_tensors"):
        pytest.importorskip(module)


@pytest.fixture(scope="module")
def checkpoints(parity_libraries, tmp_path_factory) -> dict[str, Path]:
    """Each format's checkpoint of one tiny HF Llama whose projections' block magnitudes vary."""
    from tests.fp8_checkpoints import save_compressed_tensors, save_transformers_fp8, vary_block_magnitudes
    from tests.hf_models import build_tiny_hf_llama

    # Vocabulary 512, the built-in tokenizer's, which the engine tests use.
    model = vary_block_magnitudes(build_tiny_hf_llama("llama31", vocab_size=512))
    folders = {}
    for name, (writer, arguments, _) in CHECKPOINTS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        (save_transformers_fp8 if writer == "fp8" else save_compressed_tensors)(model, folders[name], **arguments)
    return folders


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _oracle_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    from tests.fp8_checkpoints import transformers_dequantized

    return hf_logits(transformers_dequantized(folder), tokens)


def _dense_reference(loaded, misapply=None):
    """`loaded` as an unquantized model running the weights its quantized projections stand for; `misapply(q,
    scale)`, where given, replaces the square projections' (q and o) weights, to show what a wrong scale does."""
    block = nnx.merge(loaded.graphdef, loaded.params).model.layers.mlp.up_proj.block
    arrays = flat_arrays(loaded.params)
    dense = dequantized_arrays(arrays, jnp.float32, block)
    if misapply is not None:
        for name in ("model.layers.self_attn.q_proj.weight", "model.layers.self_attn.o_proj.weight"):
            dense[name] = misapply(arrays[name], arrays[name + "_scale"], block)
    layout = abstract_params(loaded.config, np.dtype(np.float32), lambda name, shape: None)
    return dataclasses.replace(loaded, graphdef=layout.graphdef, params=fill_params(layout, dense), quantization=None)


@pytest.mark.parity
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_equal_transformers_reading_the_checkpoint_and_the_dequantized_reference(checkpoints, name):
    loaded = load_model(checkpoints[name], "float32", progress=False)
    assert loaded.quantization == CHECKPOINTS[name][2]
    assert flat_arrays(loaded.params)["model.layers.mlp.down_proj.weight"].dtype == jnp.float8_e4m3fn
    tokens = random_tokens(loaded.config.vocab_size, 24)
    logits = jaxserve_logits(loaded, tokens)
    np.testing.assert_allclose(logits, _oracle_logits(checkpoints[name], tokens), atol=ORACLE_TOLERANCE, rtol=0)
    np.testing.assert_allclose(logits, jaxserve_logits(_dense_reference(loaded), tokens), atol=REFERENCE_TOLERANCE,
                               rtol=0)


# A prompt longer than a decode step (IN_PLACE_MAX_ROWS tokens): its one prefill step quantizes activations (W8A8).
W8A8_PROMPT = 96


@pytest.mark.parity
@pytest.mark.parametrize("name", ["ct-tensor", "ct-channel"])  # static and dynamic activation scales
def test_a_prefill_step_quantizes_activations_as_compressed_tensors_does(checkpoints, name):
    """W8A8: the logits of a long prompt equal transformers' on the dequantized weights with each projection's
    input fake-quantized by compressed-tensors (tests/fp8_checkpoints.py), and differ from W8A16's by far more."""
    from tests.fp8_checkpoints import quantize_inputs_as_compressed_tensors, transformers_dequantized

    loaded = load_model(checkpoints[name], "float32", progress=False)
    tokens = random_tokens(loaded.config.vocab_size, W8A8_PROMPT)
    logits = jaxserve_logits(loaded, tokens)
    w8a8 = hf_logits(quantize_inputs_as_compressed_tensors(transformers_dequantized(checkpoints[name]),
                                                           checkpoints[name]), tokens)
    w8a16 = _oracle_logits(checkpoints[name], tokens)
    np.testing.assert_allclose(logits, w8a8, atol=ORACLE_TOLERANCE, rtol=0)
    assert np.abs(w8a16 - w8a8).max() > 100 * ORACLE_TOLERANCE  # W8A16 here would fail (2.9 and 5.1 seen)


MISAPPLIED_SCALES = {
    "transposed block scales": lambda q, scale, block: dequantize(q, jnp.swapaxes(scale, -1, -2), jnp.float32, block),
    "scales per input channel": lambda q, scale, block: q.astype(jnp.float32) * scale[..., None, :],
}


@pytest.mark.parity
@pytest.mark.parametrize("name, mistake", [("ct-block", "transposed block scales"),
                                           ("fp8-block", "transposed block scales"),
                                           ("ct-channel", "scales per input channel")])
def test_a_misapplied_scale_would_move_the_logits_far_beyond_the_tolerance(checkpoints, name, mistake):
    loaded = load_model(checkpoints[name], "float32", progress=False)
    tokens = random_tokens(loaded.config.vocab_size, 24)
    wrong = jaxserve_logits(_dense_reference(loaded, MISAPPLIED_SCALES[mistake]), tokens)
    assert np.abs(wrong - _oracle_logits(checkpoints[name], tokens)).max() > 100 * ORACLE_TOLERANCE


@pytest.mark.parity
@pytest.mark.parametrize("name", ["ct-tensor", "fp8-block"])  # a per-channel and a block-scaled format
def test_the_engine_decodes_transformers_greedy_tokens(checkpoints, name):
    from tests.fp8_checkpoints import transformers_dequantized

    llm = LLM(model=str(checkpoints[name]), **ENGINE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    oracle = transformers_dequantized(checkpoints[name])
    for prompt, output in zip(PROMPTS, outputs):
        tokens = list(prompt)
        for _ in range(NEW_TOKENS):
            tokens.append(int(hf_logits(oracle, np.array([tokens]))[0, -1].argmax()))
        assert list(output.outputs[0].token_ids) == tokens[len(prompt):]


@pytest.mark.parity
def test_bf16_scales_and_kv_cache_scales_load(checkpoints, tmp_path):
    """Scales stored in bf16 (as many compressed-tensors repositories have them) are read exactly: they give the
    logits of the same values stored in float32 (transformers would multiply in bf16, so its reading of the bf16
    folder is no oracle). A kv_cache_scheme's k_scale / v_scale tensors are no weights (a pool in the model's
    dtype ignores them)."""
    import torch

    from tests.fp8_checkpoints import edit_tensors

    def scales(tensors: dict, dtype) -> dict:
        return {name: tensor.to(torch.bfloat16).to(dtype) for name, tensor in tensors.items()
                if name.endswith("weight_scale")}

    in_float32 = _copy(checkpoints["ct-channel"], tmp_path / "float32")
    edit_tensors(in_float32, lambda tensors: tensors.update(scales(tensors, torch.float32)))
    in_bf16 = _copy(in_float32, tmp_path / "bf16")
    edit_tensors(in_bf16, lambda tensors: tensors.update(
        scales(tensors, torch.bfloat16)
        | {f"model.layers.{layer}.self_attn.{kv}_scale": torch.tensor([0.1]) for layer in (0, 1) for kv in "kv"}))
    config = json.loads((in_bf16 / "config.json").read_text())["quantization_config"]
    edit_config(in_bf16, quantization_config={**config, "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                            "strategy": "tensor", "dynamic": False}})
    loaded = load_model(in_bf16, "float32", progress=False)
    tokens = random_tokens(loaded.config.vocab_size, 16)
    np.testing.assert_allclose(jaxserve_logits(loaded, tokens), _oracle_logits(in_float32, tokens),
                               atol=ORACLE_TOLERANCE, rtol=0)


@pytest.mark.parity
def test_the_checkpoint_decides_the_format_and_contradicting_flags_or_conversion_are_refused(checkpoints, tmp_path):
    folder = checkpoints["fp8-block"]
    assert plan_model(folder, "float32", quantization="fp8").quantization == CHECKPOINTS["fp8-block"][2]
    with pytest.raises(ConfigError, match=r"--quantization int8 contradicts the checkpoint's own scheme, fp8 "
                                          r"\(transformers fp8, 32x32 block scales\)"):
        plan_model(folder, "float32", quantization="int8")
    with pytest.raises(ModelLoadError, match=r"holds a pre-quantized checkpoint \(fp8 \(transformers fp8"):
        convert_hf_to_orbax(folder, tmp_path / "converted", progress=False)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _reshape(name, shape):
    return lambda tensors: tensors.update({name: tensors[name].reshape(shape)})


def _as_bf16(name):
    import torch

    return lambda tensors: tensors.update({name: tensors[name].float().to(torch.bfloat16)})


# (checkpoint, edit of its tensors, config.json's quantization_config removed, error, message)
DAMAGED_CHECKPOINTS = {
    "missing weight_scale": ("ct-channel", _drop("model.layers.1.self_attn.k_proj.weight_scale"), False,
                             ModelLoadError, r"lacks 1 tensor.*: model\.layers\.1\.self_attn\.k_proj\.weight_scale$"),
    "missing weight_scale_inv": ("fp8-block", _drop("model.layers.0.mlp.up_proj.weight_scale_inv"), False,
                                 ModelLoadError, r"lacks 1 tensor.*: model\.layers\.0\.mlp\.up_proj\.weight_scale_inv"),
    "missing static input_scale": ("ct-tensor", _drop("model.layers.1.mlp.down_proj.input_scale"), False,
                                   ModelLoadError, r"lacks 1 tensor.*: model\.layers\.1\.mlp\.down_proj\.input_scale$"),
    "channel scale of the wrong shape": (
        "ct-channel", _reshape("model.layers.0.mlp.up_proj.weight_scale", (160,)), False, ModelLoadError,
        r"model\.layers\.0\.mlp\.up_proj\.weight_scale in model\.safetensors has shape \(160,\) but config implies "
        r"\(160, 1\)"),
    "block scale transposed": (
        "fp8-block", _reshape("model.layers.1.mlp.gate_proj.weight_scale_inv", (2, 5)), False, ModelLoadError,
        r"model\.layers\.1\.mlp\.gate_proj\.weight_scale_inv in model\.safetensors has shape \(2, 5\) but config "
        r"implies \(5, 2\)"),
    "bf16 weight among float8 ones": ("ct-channel", _as_bf16("model.layers.0.self_attn.v_proj.weight"), False,
                                      ModelLoadError, r"model\.layers\.0\.self_attn\.v_proj\.weight in .* has dtype "
                                                      r"bfloat16, but the checkpoint's quantization_config stores it "
                                                      r"as float8_e4m3fn"),
    "float8 weights without quantization_config": (
        "ct-channel", lambda tensors: None, True, UnsupportedModelError,
        r"tensor model\.layers\.0\.\S+_proj\.weight in .* is float8 \(float8_e4m3fn\), but config\.json "
        r"has no quantization_config"),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_damaged_checkpoints_are_refused_naming_the_tensor(checkpoints, tmp_path, case):
    from tests.fp8_checkpoints import edit_tensors

    name, edit, strip_config, error, message = DAMAGED_CHECKPOINTS[case]
    folder = _copy(checkpoints[name], tmp_path)
    edit_tensors(folder, edit)
    if strip_config:
        edit_config(folder, quantization_config=None)
    with pytest.raises(error, match=message):
        plan_model(folder, "float32")


# Configs as the formats write them (compressed-tensors' from tests/fp8_checkpoints.py's writer, fp8's from
# Qwen3-*-FP8), varied by each case below.
CT_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
              "group_size": None}
CT_GROUP = {"targets": ["Linear"], "weights": CT_WEIGHTS, "input_activations": None, "output_activations": None,
            "format": "float-quantized"}
CT_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": CT_GROUP}, "ignore": ["lm_head"], "kv_cache_scheme": None,
             "sparsity_config": {}, "transform_config": {}}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head"]}


def _ct(weights=None, group=None, **config):
    """CT_CONFIG with its one group's weights and group fields, and its own fields, changed."""
    group_0 = {**CT_GROUP, "weights": {**CT_WEIGHTS, **(weights or {})}, **(group or {})}
    return {**CT_CONFIG, "config_groups": {"group_0": group_0}, **config}


UNSUPPORTED_CONFIGS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, r"quant_method 'awq' is not supported"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     r"quant_method 'bitsandbytes' is not supported"),
    "int8 weights": (_ct(weights={"type": "int"}), r"weights of type 'int' with num_bits 8 are not supported"),
    "4-bit weights": (_ct(weights={"num_bits": 4}), r"weights of type 'float' with num_bits 4 are not supported"),
    "group strategy": (_ct(weights={"strategy": "group", "group_size": 128}),
                       r"weight strategy 'group' is not supported \(tensor, channel, block\)"),
    "asymmetric weights": (_ct(weights={"symmetric": False}), r"weights must be symmetric and static"),
    "groups that differ": (
        {**CT_CONFIG, "config_groups": {"group_0": CT_GROUP, "group_1": {
            **CT_GROUP, "targets": ["re:.*mlp.*"], "weights": {**CT_WEIGHTS, "strategy": "tensor"}}}},
        r"config groups group_0, group_1 quantize differently"),
    "packed format": (_ct(format="pack-quantized"), r"format 'pack-quantized' is not supported"),
    "static per-token inputs": (_ct(group={"input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                 "dynamic": False}}),
                                r"static input activations with strategy 'token' are not supported"),
    "int8 activations": (_ct(group={"input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                          "dynamic": True}}),
                         r"input activations of type 'int' with num_bits 8 are not supported"),
    "output activations": (_ct(group={"output_activations": {"num_bits": 8, "type": "float"}}),
                           r"output_activations quantization is not supported"),
    "rotations": (_ct(transform_config={"config_groups": {"u": {}}}), r"transform_config .* not supported"),
    "fp8 per tensor": ({**FP8_CONFIG, "weight_block_size": None}, r"without weight_block_size"),
    "fp8 static activations": ({**FP8_CONFIG, "activation_scheme": "static"},
                               r"activation_scheme 'static' are not supported"),
    "fp8 power-of-two scales": ({**FP8_CONFIG, "scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0' are not supported"),
    "fp8 e5m2": ({**FP8_CONFIG, "fmt": "e5m2"}, r"fmt 'e5m2' are not supported"),
}
MALFORMED_CONFIGS = {
    "block without block_structure": (_ct(weights={"strategy": "block"}),
                                      r"block_structure must be two positive integers, got None"),
    "one-number block size": ({**FP8_CONFIG, "weight_block_size": [128]},
                              r"weight_block_size must be two positive integers, got \[128\]"),
}


@pytest.mark.parametrize("case", UNSUPPORTED_CONFIGS)
def test_unsupported_schemes_are_refused_naming_the_setting(case):
    config, message = UNSUPPORTED_CONFIGS[case]
    with pytest.raises(UnsupportedModelError, match=message):
        checkpoint_quantization(config)


@pytest.mark.parametrize("case", MALFORMED_CONFIGS)
def test_malformed_block_sizes_are_refused(case):
    config, message = MALFORMED_CONFIGS[case]
    with pytest.raises(ModelLoadError, match=message):
        checkpoint_quantization(config)


def test_the_config_alone_tells_the_format():
    assert checkpoint_quantization(None) is None
    same_twice = {**CT_CONFIG, "config_groups": {"attention": {**CT_GROUP, "targets": ["re:.*self_attn.*"]},
                                                 "mlp": {**CT_GROUP, "targets": ["re:.*mlp.*"]}}}
    channel = checkpoint_quantization(same_twice)
    assert (channel.name, channel.weight_format.block, channel.scale_name) == (
        "fp8 (compressed-tensors, per-channel scales)", None, "weight_scale")
    assert channel.activations is None and not channel.weight_format.quantizes_activations  # weight-only: W8A16
    dynamic_tokens = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    dynamic = checkpoint_quantization(_ct(group={"input_activations": dynamic_tokens}))
    assert dynamic.weight_format.quantizes_activations and dynamic.weight_format.activations == "dynamic"
    assert dynamic.name == "fp8 (compressed-tensors, per-channel scales; prefill W8A8, dynamic activations)"
    static_tensor = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert checkpoint_quantization(_ct(group={"input_activations": static_tensor})).activations == "static"
    kv = checkpoint_quantization(_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}))
    assert kv.kv_cache_scales and not channel.kv_cache_scales
    # As early FP8 repositories (nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf) describe their float8 tensors.
    early = checkpoint_quantization(_ct(weights={"strategy": "tensor"}, format="naive-quantized",
                                        quantization_status="frozen"))
    assert early.name == "fp8 (compressed-tensors, per-tensor scales)"
    block = checkpoint_quantization(FP8_CONFIG)
    assert (block.weight_format, block.scale_name) == (
        dataclasses.replace(WEIGHT_FORMATS["fp8"], block=(128, 128), activations=None), "weight_scale_inv")
    assert not block.weight_format.quantizes_activations  # block-scaled checkpoints run W8A16


# A decoder projection the config leaves unquantized: (quantization_config, the projection named)
PARTLY_QUANTIZED = {
    "ignore names a projection": (_ct(ignore=["lm_head", "model.layers.1.mlp.down_proj"]),
                                  r"model\.layers\.1\.mlp\.down_proj unquantized \(quantization_config\.ignore lists "
                                  r"'model\.layers\.1\.mlp\.down_proj'\)"),
    "ignore pattern": (_ct(ignore=["re:.*lm_head", "re:.*o_proj$"]),
                       r"model\.layers\.0\.self_attn\.o_proj unquantized \(.*ignore lists 're:\.\*o_proj\$'\)"),
    "targets attention only": (_ct(group={"targets": ["re:.*self_attn.*"]}),
                               r"model\.layers\.0\.mlp\.down_proj unquantized \(no config group targets it\)"),
    "fp8 skips a projection": ({**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "down_proj"]},
                               r"model\.layers\.0\.mlp\.down_proj unquantized \(.*modules_to_not_convert lists "
                               r"'down_proj'\)"),
    "fp8 skips a layer": ({**FP8_CONFIG, "modules_to_not_convert": ["model.layers.1"]},
                          r"model\.layers\.1\.mlp\.down_proj unquantized \(.*lists .model\.layers\.1.\)"),
}


@pytest.mark.parametrize("case", PARTLY_QUANTIZED)
def test_a_decoder_projection_left_unquantized_is_refused_naming_it(tmp_path, case):
    """Checked from config.json alone, before any tensor is looked at (these folders hold float weights)."""
    config, message = PARTLY_QUANTIZED[case]
    write_tiny_checkpoint(tmp_path, quantization_config=config)
    with pytest.raises(UnsupportedModelError, match=message):
        plan_model(tmp_path, "float32")


def test_block_scales_multiply_their_blocks_and_the_partial_blocks_at_the_edges():
    block = (2, 4)
    q = jax.random.normal(jax.random.key(0), (2, 5, 7)).astype(jnp.float8_e4m3fn)  # 3 x 2 blocks, partial edges
    scale = 2.0 ** jax.random.randint(jax.random.key(1), (2, 3, 2), -3, 4)  # f32[2, 3, 2]
    rows, columns = np.arange(5)[:, None] // block[0], np.arange(7)[None, :] // block[1]
    expected = np.asarray(q, np.float32) * np.asarray(scale)[:, rows, columns]  # f32[2, 5, 7]
    np.testing.assert_array_equal(dequantize(q, scale, jnp.float32, block), expected)
    x = jax.random.normal(jax.random.key(2), (3, 7))
    np.testing.assert_allclose(scaled_matmul(x, q[1], scale[1], block), x @ expected[1].T, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tensor_parallel_report(parity_libraries, tmp_path_factory):
    work = tmp_path_factory.mktemp("quantized_tensor_parallel")
    done = subprocess.run([sys.executable, "-m", "tests.quantized_checkpoint_probe", str(work)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parity
def test_block_channel_and_int4_group_scales_split_and_repeat_with_their_weights_under_tensor_parallelism(
        tensor_parallel_report):
    for name, engines in tensor_parallel_report["engines"].items():
        single = engines["1"]
        assert all(len(tokens) > 0 for tokens in single["tokens"]), name
        for tp, engine in engines.items():
            assert engine["tokens"] == single["tokens"], (name, tp)
            assert engine["wrong_shardings"] == [] and engine["compiles_after_warmup"] == 0, (name, tp)
            assert engine["device_bytes"] == [engine["expected_device_bytes"]], (name, tp)
    # Dequantizing by blocks adds no communication: the same collectives as per-channel scales.
    engines = tensor_parallel_report["engines"]
    assert engines["block"]["4"]["collectives"] == engines["channel"]["4"]["collectives"]


@pytest.mark.slow
@pytest.mark.parity
def test_tensor_parallelism_that_would_split_a_weight_block_is_refused(tensor_parallel_report):
    refused = tensor_parallel_report["refused"]
    assert refused["kv heads repeated"].startswith(
        "tensor parallelism gives each device 16 of the 64 rows of model.layers.self_attn.k_proj.weight (its KV heads "
        "repeated, one per device), not a whole number of the checkpoint's 32x16 weight blocks")
    assert refused["row-parallel columns"].startswith(
        "tensor parallelism gives each device 64 of the 128 columns of model.layers.mlp.down_proj.weight, not a "
        "whole number of the checkpoint's 16x48 weight blocks")
    assert refused["int4 group split"] == (
        "tensor parallelism gives each device 64 of the 128 columns of model.layers.mlp.down_proj.weight, not a "
        "whole number of the checkpoint's groups of 48 columns: choose a tensor_parallel_size that splits it into "
        "whole groups")


KV_SCALES = ((0.5, 2.0), (0.25, 4.0))  # (K per layer, V per layer) of the two-layer test model


def _with_kv_cache_scales(folder: Path, names: tuple[str, str] = ("self_attn.k_scale", "self_attn.v_scale"),
                          skip: str | None = None) -> Path:
    """`folder` with a kv_cache_scheme and per-layer K/V scales under `names`, tensor `skip` left out."""
    import torch

    from tests.fp8_checkpoints import edit_tensors

    scales = {f"model.layers.{layer}.{name}": torch.tensor([values[layer]])
              for name, values in zip(names, KV_SCALES) for layer in (0, 1)}
    edit_tensors(folder, lambda tensors: tensors.update({n: t for n, t in scales.items() if n != skip}))
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    edit_config(folder, quantization_config={**config, "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                           "strategy": "tensor", "dynamic": False}})
    return folder


@pytest.mark.parity
@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),
                                   ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")])
def test_a_float8_kv_pool_takes_the_checkpoints_calibrated_scales(checkpoints, tmp_path, names):
    folder = _with_kv_cache_scales(_copy(checkpoints["ct-channel"], tmp_path), names)
    assert plan_model(folder, "float32").kv_cache_scales == KV_SCALES
    llm = LLM(model=str(folder), kv_cache_dtype="fp8", **ENGINE)
    pool = llm.engine.runner.pool
    np.testing.assert_array_equal(pool.scales.k, KV_SCALES[0])
    np.testing.assert_array_equal(pool.scales.v, KV_SCALES[1])
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    assert LLM(model=str(folder), **ENGINE).engine.runner.pool.scales is None  # a pool in the model's dtype


@pytest.mark.parity
def test_a_kv_cache_scheme_without_its_scales_is_refused_naming_the_tensor(checkpoints, tmp_path):
    folder = _with_kv_cache_scales(_copy(checkpoints["ct-channel"], tmp_path), skip="model.layers.1.self_attn.v_scale")
    with pytest.raises(ModelLoadError, match=r"kv_cache_scheme .* lacks tensor model\.layers\.1\.self_attn\.v_scale"):
        plan_model(folder, "float32")
