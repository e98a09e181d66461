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
from jaxserve.checkpoint.int4_checkpoint import unpack_int4
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.checkpoint.quantize import dequantized_arrays
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxserve.model.quantization import INT4
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
    dense = dequantized_arrays(arrays or flat_arrays(loaded.params), jnp.float32, _format(loaded).block)
    layout = abstract_params(loaded.config, np.dtype(np.float32), lambda name, shape: None)
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
    assert arrays["model.layers.mlp.down_proj.weight"].dtype == INT4
    assert ("model.layers.mlp.down_proj.weight_zero_point" in arrays) == name.endswith("asym")
    tokens = random_tokens(loaded.config.vocab_size, 24)
    logits = jaxserve_logits(loaded, tokens)
    np.testing.assert_allclose(logits, _oracle_logits(checkpoints[name], tokens), atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(logits, jaxserve_logits(_dense(loaded), tokens), atol=TOLERANCE, rtol=0)


def _reversed_nibbles(q):
    """Each word's eight values in the opposite order: what reading the nibbles from the highest bits would give."""
    values = np.asarray(q, np.int8)
    return jnp.asarray(values.reshape(*values.shape[:-1], -1, 8)[..., ::-1].reshape(values.shape), INT4)


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


def test_unpacking_reads_eight_values_a_word_lowest_bits_first():
    words = np.array([[0x76543210 - 2**32, 0xFEDCBA98 - 2**32]], np.int64).astype(np.int32)  # one row, two words
    np.testing.assert_array_equal(unpack_int4(words, 16, axis=1), [np.arange(16) - 8])
    np.testing.assert_array_equal(unpack_int4(words.T, 12, axis=0)[:, 0], np.arange(12) - 8)


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
    "act-order groups": (dict(actorder="group"), UnsupportedModelError, r"actorder 'group' \(a weight_g_idx"),
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
