"""Converting safetensors to Orbax: identical weights and logits, copied side files, and damaged checkpoints."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxserve.checkpoint import convert_hf_to_orbax, load_model
from jaxserve.checkpoint.param_tree import flat_arrays
from jaxserve.errors import ModelLoadError
from tests.hf_models import (
    assert_same_tensors,
    edit_config,
    jaxserve_logits,
    load_arrays,
    random_tokens,
    write_tiny_checkpoint,
)

SIDE_FILES = {
    "generation_config.json": '{"eos_token_id": [1, 2]}',
    "tokenizer.json": '{"model": {}}',
    "tokenizer_config.json": '{"bos_token": "<s>"}',
    "special_tokens_map.json": "{}",
    "chat_template.jinja": "{{ messages }}",
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF folder, converted folder) of a float32 tiny model with tokenizer files, converted once for the module."""
    root = tmp_path_factory.mktemp("converted")
    write_tiny_checkpoint(root / "hf")
    for name, text in SIDE_FILES.items():
        (root / "hf" / name).write_text(text)
    (root / "hf" / "README.md").write_text("not needed for serving")
    convert_hf_to_orbax(root / "hf", root / "out", progress=False)
    return root / "hf", root / "out"


@pytest.fixture
def converted_copy(converted, tmp_path):
    """A private copy of the converted folder, for tests that damage it."""
    return shutil.copytree(converted[1], tmp_path / "out")


def test_converted_folder_restores_identical_params_and_logits(converted):
    hf_dir, out_dir = converted
    from_safetensors = load_model(hf_dir, "float32", progress=False)
    from_orbax = load_model(out_dir, "float32", progress=False)
    assert from_orbax.source == "orbax" and from_orbax.model_dir == out_dir
    assert from_orbax.config == from_safetensors.config
    assert_same_tensors(load_arrays(out_dir), load_arrays(hf_dir))
    tokens = random_tokens(from_orbax.config.vocab_size, 24)
    np.testing.assert_array_equal(jaxserve_logits(from_orbax, tokens), jaxserve_logits(from_safetensors, tokens))


def test_config_and_tokenizer_files_are_copied_and_nothing_else(converted):
    hf_dir, out_dir = converted
    for name in ["config.json", *SIDE_FILES]:
        assert (out_dir / name).read_bytes() == (hf_dir / name).read_bytes(), name
    assert sorted(path.name for path in out_dir.iterdir()) == sorted(["config.json", "orbax", *SIDE_FILES])


@pytest.mark.parametrize("checkpoint_dtype, load_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_weights_keep_their_stored_dtype_and_cast_on_restore_like_safetensors(tmp_path, checkpoint_dtype, load_dtype):
    write_tiny_checkpoint(tmp_path / "hf", dtype=checkpoint_dtype)
    convert_hf_to_orbax(tmp_path / "hf", tmp_path / "out", progress=False)
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata((tmp_path / "out" / "orbax").absolute()).item_metadata.tree
    assert {meta.dtype for meta in stored.values()} == {jnp.dtype(checkpoint_dtype)}
    restored = load_model(tmp_path / "out", load_dtype, progress=False)
    assert restored.dtype == jnp.dtype(load_dtype)
    assert_same_tensors(load_arrays(tmp_path / "out", load_dtype), load_arrays(tmp_path / "hf", load_dtype))


def test_converting_in_place_makes_the_folder_load_from_orbax(tmp_path):
    write_tiny_checkpoint(tmp_path)
    before = load_arrays(tmp_path)
    convert_hf_to_orbax(tmp_path, tmp_path, progress=False)
    assert load_model(tmp_path, "float32", progress=False).source == "orbax"
    assert_same_tensors(load_arrays(tmp_path), before)


def test_conversion_refuses_to_overwrite_a_checkpoint(converted):
    hf_dir, out_dir = converted
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_hf_to_orbax(hf_dir, out_dir, progress=False)


def test_converting_a_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_hf_to_orbax(tmp_path / "nowhere", tmp_path / "out", progress=False)


def test_an_unfinished_conversion_is_reported(converted_copy):
    # What an interrupted save leaves behind: Orbax renames the temporary folder only once the save has committed.
    (converted_copy / "orbax").rename(converted_copy / "orbax.orbax-checkpoint-tmp-1700000000")
    with pytest.raises(ModelLoadError, match="did not finish"):
        load_model(converted_copy, "float32", progress=False)


def _drop_metadata(orbax_dir):
    (orbax_dir / "_METADATA").unlink()


def _empty_the_folder(orbax_dir):
    shutil.rmtree(orbax_dir)
    orbax_dir.mkdir()


def _truncate_data_files(orbax_dir):
    for data_file in (orbax_dir / "ocdbt.process_0" / "d").iterdir():
        data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_drop_metadata, _empty_the_folder, _truncate_data_files])
def test_a_damaged_checkpoint_raises_model_load_error(converted_copy, damage):
    damage(converted_copy / "orbax")
    with pytest.raises(ModelLoadError, match=r"Orbax checkpoint .*orbax is damaged or incomplete"):
        load_model(converted_copy, "float32", progress=False)


def test_a_config_that_no_longer_matches_names_the_tensor(converted_copy):
    edit_config(converted_copy, intermediate_size=200)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight in orbax has shape \(192, 64\)"):
        load_model(converted_copy, "float32", progress=False)


def test_restored_weights_live_on_the_default_device(converted):
    params = flat_arrays(load_model(converted[1], "float32", progress=False).params)
    assert {device for array in params.values() for device in array.devices()} == {jax.devices()[0]}
