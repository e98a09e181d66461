"""Loading HF safetensors folders: layouts, dtypes, streaming, and error messages that name the culprit."""

import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.checkpoint import BUILTIN_MODEL_DIR, load_model
from jaxserve.checkpoint import safetensors_loader, shard_placement
from jaxserve.checkpoint.param_tree import flat_arrays
from jaxserve.errors import ModelLoadError, UnsupportedModelError
from jaxserve.model.dtypes import resolve_dtype
from tests.hf_models import assert_same_tensors, edit_config, load_arrays, write_tiny_checkpoint

SMALL_SHARD_BYTES = 40_000  # the float32 tiny model is ~0.5 MB, so this gives over ten shards


def rewrite_single_file(folder, tensors):
    save_file(tensors, folder / "model.safetensors")


# Layouts and dtypes


def test_single_file_loads_exactly_the_stored_tensors(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    loaded = load_model(tmp_path, "float32", progress=False)
    assert loaded.source == "safetensors" and loaded.model_dir == tmp_path and loaded.dtype == jnp.float32
    assert_same_tensors(load_arrays(tmp_path), tensors)


def test_sharded_and_single_file_checkpoints_load_equal(tmp_path):
    write_tiny_checkpoint(tmp_path / "single")
    write_tiny_checkpoint(tmp_path / "sharded", max_shard_bytes=SMALL_SHARD_BYTES)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 5
    assert_same_tensors(load_arrays(tmp_path / "sharded"), load_arrays(tmp_path / "single"))


def test_bfloat16_checkpoint_loads_as_bfloat16_on_request(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path, dtype="bfloat16")
    loaded = load_model(tmp_path, "bf16", progress=False)
    assert loaded.dtype == jnp.bfloat16
    assert_same_tensors(load_arrays(tmp_path, "bfloat16"), tensors)


def test_auto_dtype_is_float32_on_cpu(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path, dtype="bfloat16")
    assert load_model(tmp_path, "auto", progress=False).dtype == jnp.float32
    upcast = {name: array.astype(np.float32) for name, array in tensors.items()}
    assert_same_tensors(load_arrays(tmp_path, "auto"), upcast)


def test_float32_checkpoint_downcasts_to_float16(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    downcast = {name: array.astype(np.float16) for name, array in tensors.items()}
    assert_same_tensors(load_arrays(tmp_path, "half"), downcast)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    buffer = np.ones(8, np.float32)
    rewrite_single_file(tmp_path, {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": buffer})
    assert_same_tensors(load_arrays(tmp_path), tensors)


def test_tied_model_ignores_a_redundant_lm_head(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in tensors
    rewrite_single_file(tmp_path, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert_same_tensors(load_arrays(tmp_path), tensors)


# Streaming


def test_tensors_are_read_once_each_and_never_two_at_a_time_on_the_host(tmp_path, monkeypatch):
    tensors = write_tiny_checkpoint(tmp_path, max_shard_bytes=SMALL_SHARD_BYTES)
    read_names, alive = [], []
    real_slice, real_read = safetensors_loader.tensor_slice, shard_placement.read_shard

    def spying_slice(reader, name, file):
        assert not [ref for ref in alive if ref() is not None], "a previous host tensor is still alive"
        read_names.append(name)
        return real_slice(reader, name, file)

    def spying_read(source, index, stored_rows):
        array = real_read(source, index, stored_rows)
        alive.append(weakref.ref(array))
        return array

    monkeypatch.setattr(safetensors_loader, "tensor_slice", spying_slice)
    monkeypatch.setattr(shard_placement, "read_shard", spying_read)
    # Cast on load: on the CPU backend a same-dtype device_put may alias the host buffer, which is then the device
    # copy itself rather than a second one, and would make this check depend on buffer alignment.
    load_model(tmp_path, "bfloat16", progress=False)
    assert sorted(read_names) == sorted(tensors)


def test_a_config_mismatch_fails_before_any_tensor_is_read(tmp_path, monkeypatch):
    write_tiny_checkpoint(tmp_path)
    edit_config(tmp_path, num_hidden_layers=3)

    def must_not_read(reader, name, file):
        raise AssertionError(f"read {name} before the headers were checked")

    monkeypatch.setattr(safetensors_loader, "tensor_slice", must_not_read)
    with pytest.raises(ModelLoadError, match="model.layers.2"):
        load_model(tmp_path, "float32", progress=False)


def test_progress_bar_only_when_asked(tmp_path, capsys):
    write_tiny_checkpoint(tmp_path)
    load_model(tmp_path, "float32", progress=False)
    assert "Loading safetensors" not in capsys.readouterr().err
    load_model(tmp_path, "float32", progress=True)
    assert "Loading safetensors" in capsys.readouterr().err


# Errors that name the tensor or file at fault


def test_missing_tensor_is_named(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    rewrite_single_file(tmp_path, tensors)
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path, "float32", progress=False)


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    rewrite_single_file(tmp_path, {**tensors, "model.layers.0.mlp.extra_proj.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight \(in model\.safetensors\)"):
        load_model(tmp_path, "float32", progress=False)


def test_lm_head_of_another_shape_is_unexpected_in_a_tied_model(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    rewrite_single_file(tmp_path, {**tensors, "lm_head.weight": np.ones((3, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(tmp_path, "float32", progress=False)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    write_tiny_checkpoint(tmp_path)
    edit_config(tmp_path, intermediate_size=200)
    expected = (
        r"model\.layers\.0\.mlp\.up_proj\.weight in model\.safetensors "
        r"has shape \(192, 64\) but config implies \(200, 64\)"
    )
    with pytest.raises(ModelLoadError, match=expected):
        load_model(tmp_path, "float32", progress=False)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_truncated_file_is_named(tmp_path, sharded):
    write_tiny_checkpoint(tmp_path, max_shard_bytes=SMALL_SHARD_BYTES if sharded else None)
    victim = sorted(tmp_path.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=f"{victim.name} is not a valid safetensors file"):
        load_model(tmp_path, "float32", progress=False)


def test_index_naming_a_missing_shard(tmp_path):
    write_tiny_checkpoint(tmp_path, max_shard_bytes=SMALL_SHARD_BYTES)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"names shard {victim.name}, which is missing"):
        load_model(tmp_path, "float32", progress=False)


def test_quantized_tensor_is_unsupported_and_named(tmp_path):
    tensors = write_tiny_checkpoint(tmp_path)
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.ones((64, 64), np.int8)
    rewrite_single_file(tmp_path, tensors)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight .* dtype I8"):
        load_model(tmp_path, "float32", progress=False)


def test_nonexistent_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere", progress=False)


def test_folder_without_config(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, progress=False)


def test_folder_with_config_but_no_weights(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in"):
        load_model(tmp_path, progress=False)


def test_pytorch_only_weights_get_a_hint(tmp_path):
    write_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="PyTorch weights"):
        load_model(tmp_path, progress=False)


# dtype resolution


@pytest.mark.parametrize(
    "requested, expected",
    [("bfloat16", jnp.bfloat16), ("BF16", jnp.bfloat16), ("float16", jnp.float16), ("fp16", jnp.float16),
     ("half", jnp.float16), ("float32", jnp.float32), ("fp32", jnp.float32), ("float", jnp.float32)],
)
def test_explicit_dtype_names(requested, expected):
    assert resolve_dtype(requested, "bfloat16", "gpu") == expected
    assert resolve_dtype(requested, "bfloat16", "cpu") == expected


@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float16", "float32"])
def test_auto_keeps_the_checkpoint_dtype_on_gpu_and_uses_float32_on_cpu(checkpoint_dtype):
    assert resolve_dtype("auto", checkpoint_dtype, "gpu") == jnp.dtype(checkpoint_dtype)
    assert resolve_dtype("auto", checkpoint_dtype, "cpu") == jnp.float32


def test_unknown_dtype_is_rejected_with_the_choices():
    with pytest.raises(ModelLoadError, match=r"^unknown dtype 'int4' \(choose auto, bfloat16, float16, float32\)$"):
        resolve_dtype("int4", "bfloat16", "gpu")


def test_auto_with_an_unrunnable_checkpoint_dtype_asks_for_an_explicit_one():
    with pytest.raises(ModelLoadError, match="config.json declares dtype 'float64'"):
        resolve_dtype("auto", "float64", "gpu")


def test_load_model_rejects_an_unknown_dtype(tmp_path):
    write_tiny_checkpoint(tmp_path)
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(tmp_path, "float8", progress=False)


# The built-in model


def test_builtin_model_is_deterministic_and_points_at_its_tokenizer_folder():
    first, second = load_model(None, "float32"), load_model(None, "float32")
    assert first.source == "builtin" and first.model_dir == BUILTIN_MODEL_DIR
    assert first.config.vocab_size == 512 and first.dtype == jnp.float32
    first_arrays, second_arrays = flat_arrays(first.params), flat_arrays(second.params)
    for name, array in first_arrays.items():
        np.testing.assert_array_equal(np.asarray(array), np.asarray(second_arrays[name]), err_msg=name)


def test_builtin_model_honours_the_dtype():
    loaded = load_model(None, "bfloat16")
    assert loaded.dtype == jnp.bfloat16
    assert {array.dtype for array in flat_arrays(loaded.params).values()} == {jnp.dtype(jnp.bfloat16)}
