"""PEFT LoRA adapter folders read into host arrays (jaxserve/checkpoint/lora_adapter.py and lora_config.py).

Parity tests take the real peft library as the oracle: a tiny HF Llama wrapped by `peft.get_peft_model` under one
LoraConfig per case (all seven projections, a subset, rsLoRA, layers_to_transform, r=8, a regex, "all-linear",
exclude_modules), its lora_B weights made non-zero (peft starts B at zero, under which every delta would agree),
saved by peft's `save_pretrained`. The loaded A and B must equal peft's tensors bit for bit (zeros in layers left
out), the scaling must be peft's own, and scaling * B @ A must be what peft's merge_and_unload adds to each weight.

The refusal tests need no torch: `_write_adapter` writes an adapter folder with numpy in the format peft writes (a
parity test checks it against peft's own save, name for name and key for key), which each test then damages or
edits one way; each must raise its error class with a message naming what is wrong.
"""

import copy
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxserve.checkpoint.lora_adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, load_lora_adapter
from jaxserve.checkpoint.lora_config import PROJECTIONS, module_name
from jaxserve.checkpoint.random_lora import PEFT_PREFIX, write_random_lora_adapter
from jaxserve.errors import (ConfigError, LoraAdapterError, LoraBaseModelMismatchError, LoraRankError,
                             UnsupportedLoraError)
from jaxserve.model.config import LlamaConfig

MAX_LORA_RANK = 8
# tests/hf_models.py's tiny "llama31" shape: grouped-query attention, so k/v differ from q in width.
BASE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
PREFIX = PEFT_PREFIX
# float32: peft's merge adds B @ A * scaling to W; the loader's delta is scaling * B @ A; they differ by rounding.
DELTA_TOLERANCE = dict(atol=1e-6, rtol=1e-5)


def _write_adapter(folder: Path, base: LlamaConfig = BASE, **options) -> dict[str, np.ndarray]:
    """A random adapter folder in peft's format, shaped for `base` (the tiny HF Llama's shape by default)."""
    return write_random_lora_adapter(folder, base, **options)


def _load(folder: Path, base: LlamaConfig = BASE, max_lora_rank: int = MAX_LORA_RANK):
    return load_lora_adapter(folder, base, max_lora_rank)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / ADAPTER_CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rewrite_tensors(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, folder / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})


# ---- parity with peft ----------------------------------------------------------------------------------------------

ALL_PROJECTIONS = list(PROJECTIONS)
ADAPTERS = {
    "all projections": dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS),
    "subset": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], layers_to_transform=[1]),
    "r8 alpha16": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "regex": dict(r=4, lora_alpha=8, target_modules=r".*\.(q|v|down)_proj"),
    # peft saves "all-linear" expanded into every projection's full name.
    "all-linear": dict(r=2, lora_alpha=3, target_modules="all-linear"),
    "exclude_modules": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                            exclude_modules=["model.layers.0.self_attn.o_proj"]),
}
_PEFT_MODULE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)$")


@dataclasses.dataclass
class SavedAdapter:
    folder: Path  # what peft's save_pretrained wrote
    config: LlamaConfig  # the base model's, read from its HF config
    model: object  # the peft.PeftModel (lora_B randomised) that was saved
    original: dict  # the base model's state dict before peft wrapped it: parameter name -> tensor

    def lora_layers(self) -> dict[tuple[str, int], object]:
        """(projection, layer) -> peft's LoRA layer wrapping it."""
        from peft.tuners.lora import LoraLayer

        return {(match[2], int(match[1])): module for name, module in self.model.named_modules()
                if isinstance(module, LoraLayer) and (match := _PEFT_MODULE.match(name))}


@pytest.fixture(scope="module")
def parity_libraries():
    for module in ("torch", "transformers", "peft"):
        pytest.importorskip(module)


def _peft_save(folder: Path, settings: dict, seed: int = 0, **save_options) -> SavedAdapter:
    """A tiny HF Llama wrapped by peft under LoraConfig(**settings), lora_B randomised, saved into `folder`."""
    import peft
    import torch

    from tests.hf_models import build_tiny_hf_llama

    base = build_tiny_hf_llama("llama31", seed=seed)
    config = LlamaConfig.from_hf_dict(base.config.to_dict())
    original = {name: tensor.detach().clone() for name, tensor in base.state_dict().items()}
    model = peft.get_peft_model(base, peft.LoraConfig(**settings))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn_like(param))
    model.save_pretrained(folder, **save_options)
    return SavedAdapter(folder, config, model, original)


@pytest.fixture(scope="module", params=ADAPTERS)
def saved(request, parity_libraries, tmp_path_factory) -> SavedAdapter:
    return _peft_save(tmp_path_factory.mktemp("adapter"), ADAPTERS[request.param])


@pytest.mark.parity
def test_a_and_b_equal_peft_tensors_and_left_out_layers_are_zero(saved):
    adapter = _load(saved.folder, saved.config)
    peft_layers = saved.lora_layers()
    assert adapter.target_modules == tuple(p for p in PROJECTIONS if any(p == key[0] for key in peft_layers))
    assert adapter.rank == saved.model.peft_config["default"].r
    for projection, weights in adapter.weights.items():
        assert weights.a.dtype == weights.b.dtype == np.float32
        assert weights.layers == tuple(layer for p, layer in sorted(peft_layers, key=lambda key: key[1])
                                       if p == projection)
        for layer in range(saved.config.num_hidden_layers):
            lora = peft_layers.get((projection, layer))
            if lora is None:
                assert not weights.a[layer].any() and not weights.b[layer].any()
                continue
            np.testing.assert_array_equal(weights.a[layer], lora.lora_A["default"].weight.detach().numpy())
            np.testing.assert_array_equal(weights.b[layer], lora.lora_B["default"].weight.detach().numpy())


@pytest.mark.parity
def test_scaling_equals_peft(saved):
    adapter = _load(saved.folder, saved.config)
    scalings = {lora.scaling["default"] for lora in saved.lora_layers().values()}
    assert scalings == {adapter.scaling}


@pytest.mark.parity
def test_delta_equals_what_peft_merges_into_each_weight(saved):
    adapter = _load(saved.folder, saved.config)
    merged = copy.deepcopy(saved.model).merge_and_unload().state_dict()
    for projection in PROJECTIONS:
        for layer in range(saved.config.num_hidden_layers):
            weight = f"{module_name(projection, layer)}.weight"
            expected = (merged[weight] - saved.original[weight]).numpy()
            if projection not in adapter.weights:
                assert not expected.any(), weight
                continue
            delta = adapter.delta(projection, layer)
            assert delta.dtype == np.float32
            np.testing.assert_allclose(delta, expected, err_msg=weight, **DELTA_TOLERANCE)
            assert expected.any() == (layer in adapter.weights[projection].layers), weight


@pytest.mark.parity
def test_the_test_writer_writes_what_peft_writes(parity_libraries, tmp_path):
    """`_write_adapter`, which the refusal tests start from, agrees with peft's own save: config keys and values,
    tensor names, dtypes and shapes."""
    peft_folder, ours = tmp_path / "peft", tmp_path / "ours"
    _peft_save(peft_folder, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    _write_adapter(ours)
    theirs_config = json.loads((peft_folder / ADAPTER_CONFIG_FILE).read_text())
    our_config = json.loads((ours / ADAPTER_CONFIG_FILE).read_text())
    assert sorted(theirs_config.pop("target_modules")) == sorted(our_config.pop("target_modules"))
    assert theirs_config == our_config

    def described(folder):
        with safe_open(folder / ADAPTER_WEIGHTS_FILE, "np") as f:
            return f.metadata(), {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
                                  for name in f.keys()}

    assert described(peft_folder) == described(ours)


@pytest.mark.parity
def test_peft_pickle_save_is_refused_naming_the_file(parity_libraries, tmp_path):
    _peft_save(tmp_path, dict(r=4, lora_alpha=8, target_modules=["q_proj"]), safe_serialization=False)
    assert (tmp_path / "adapter_model.bin").is_file()
    with pytest.raises(UnsupportedLoraError, match=r"holds adapter_model\.bin, a pickle file.*convert it to "
                                                   r"adapter_model\.safetensors"):
        _load(tmp_path)


@pytest.mark.parity
@pytest.mark.parametrize("settings, error, message", [
    (dict(use_dora=True), UnsupportedLoraError, r"use_dora=True: DoRA"),
    (dict(lora_bias=True), UnsupportedLoraError, r"lora_bias=True"),
    (dict(target_modules=["q_proj", "embed_tokens"]), UnsupportedLoraError, r"reaches model\.embed_tokens"),
    (dict(modules_to_save=["lm_head"]), UnsupportedLoraError, r"modules_to_save=\['lm_head'\]"),
    (dict(rank_pattern={"q_proj": 2}), UnsupportedLoraError, r"rank_pattern gives model\.layers\.0\.self_attn\."
                                                              r"q_proj 2 instead of 4"),
    (dict(alpha_pattern={"v_proj": 3}), UnsupportedLoraError, r"alpha_pattern gives model\.layers\.0\.self_attn\."
                                                               r"v_proj 3 instead of 8"),
    (dict(r=16, lora_alpha=32), LoraRankError, r"rank r=16 is above the server's max_lora_rank \(8\)"),
])
def test_peft_saves_of_unsupported_adapters_are_refused(parity_libraries, tmp_path, settings, error, message):
    _peft_save(tmp_path, dict(dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), **settings))
    with pytest.raises(error, match=message):
        _load(tmp_path)


# ---- loading without torch -----------------------------------------------------------------------------------------

def test_written_adapter_loads_with_scaling_alpha_over_r(tmp_path):
    tensors = _write_adapter(tmp_path / "a", lora_alpha=12)
    adapter = _load(tmp_path / "a")
    assert (adapter.name, adapter.path, adapter.rank, adapter.scaling) == ("a", tmp_path / "a", 4, 3.0)
    assert adapter.target_modules == ("q_proj", "v_proj")
    np.testing.assert_array_equal(adapter.weights["v_proj"].b[1],
                                  tensors[f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"])
    assert load_lora_adapter(tmp_path / "a", BASE, MAX_LORA_RANK, name="mine").name == "mine"


def test_transformers_naming_without_the_peft_prefix_loads_the_same(tmp_path):
    """transformers' own adapter saving (`model.add_adapter`, `save_pretrained`) writes names without
    base_model.model. (its integration needs peft >= 0.22, so the names are written here)."""
    _write_adapter(tmp_path / "peft")
    _write_adapter(tmp_path / "transformers", prefix="")
    ours, theirs = _load(tmp_path / "peft"), _load(tmp_path / "transformers")
    for projection in ours.weights:
        np.testing.assert_array_equal(ours.weights[projection].a, theirs.weights[projection].a)
        np.testing.assert_array_equal(ours.weights[projection].b, theirs.weights[projection].b)


def test_half_precision_weights_are_widened_exactly(tmp_path):
    tensors = _write_adapter(tmp_path, dtype=np.float16)
    adapter = _load(tmp_path)
    name = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter.weights["q_proj"].a.dtype == np.float32
    np.testing.assert_array_equal(adapter.weights["q_proj"].a[0], tensors[name].astype(np.float32))


def test_rank_equal_to_max_lora_rank_loads_and_the_base_model_name_is_informational(tmp_path):
    _write_adapter(tmp_path, rank=MAX_LORA_RANK, base_model_name_or_path="someone/another-model")
    adapter = _load(tmp_path)
    assert adapter.rank == MAX_LORA_RANK and adapter.base_model_name_or_path == "someone/another-model"


@pytest.mark.parametrize("changes", [dict(rank_pattern={"q_proj": 4}, alpha_pattern={"k_proj": 99}),
                                     dict(fan_in_fan_out=True), dict(init_lora_weights="gaussian")])
def test_settings_that_change_nothing_here_are_accepted(tmp_path, changes):
    """A pattern that repeats r or names a module not adapted; fan_in_fan_out, which peft ignores for linear
    layers; an initialisation that leaves the base weights alone."""
    _write_adapter(tmp_path, **changes)
    assert _load(tmp_path).target_modules == ("q_proj", "v_proj")


def test_arrays_are_read_only_and_a_failed_load_changes_nothing(tmp_path):
    _write_adapter(tmp_path / "good")
    adapter = _load(tmp_path / "good")
    before = {p: (w.a.copy(), w.b.copy()) for p, w in adapter.weights.items()}
    with pytest.raises(ValueError, match="read-only"):
        adapter.weights["q_proj"].a[0, 0, 0] = 1.0
    _write_adapter(tmp_path / "bad", use_dora=True)
    files = {path: path.read_bytes() for path in (tmp_path / "bad").iterdir()}
    with pytest.raises(UnsupportedLoraError):
        _load(tmp_path / "bad")
    assert {path: path.read_bytes() for path in (tmp_path / "bad").iterdir()} == files
    for projection, (a, b) in before.items():
        np.testing.assert_array_equal(adapter.weights[projection].a, a)
        np.testing.assert_array_equal(adapter.weights[projection].b, b)


# ---- refusals ------------------------------------------------------------------------------------------------------

REFUSED_SETTINGS = [
    (dict(peft_type="LOHA"), UnsupportedLoraError, r"peft_type 'LOHA'; jaxserve serves LoRA adapters"),
    (dict(use_dora=True), UnsupportedLoraError, r"DoRA \(use_dora\)"),
    (dict(lora_bias=True), UnsupportedLoraError, r"lora_bias=True"),
    (dict(bias="all"), UnsupportedLoraError, r"bias='all'"),
    (dict(bias="lora_only"), UnsupportedLoraError, r"bias='lora_only'"),
    (dict(modules_to_save=["lm_head"]), UnsupportedLoraError, r"modules_to_save"),
    (dict(trainable_token_indices=[5, 6]), UnsupportedLoraError, r"trained token embeddings"),
    (dict(layer_replication=[[0, 2], [1, 2]]), UnsupportedLoraError, r"layer_replication"),
    (dict(alora_invocation_tokens=[3, 4]), UnsupportedLoraError, r"activated LoRA"),
    (dict(init_lora_weights="pissa_niter_4"), UnsupportedLoraError, r"path_initial_model_for_weight_conversion"),
    (dict(init_lora_weights="olora"), UnsupportedLoraError, r"changes the base model's weights"),
    (dict(target_modules=["q_proj", "v_proj", "lm_head"]), UnsupportedLoraError, r"reaches lm_head"),
    (dict(target_modules=["q_proj", "v_proj", "input_layernorm"]), UnsupportedLoraError,
     r"reaches model\.layers\.0\.input_layernorm"),
    (dict(target_modules=r".*\.(q|v)_proj|lm_head"), UnsupportedLoraError, r"reaches lm_head"),
    (dict(target_modules=["q_proj", "v_proj", "fc1"]), LoraBaseModelMismatchError,
     r"target_modules entry 'fc1' matches no module of the base model"),
    (dict(target_modules="("), LoraAdapterError, r"'\(' is not a valid regular expression"),
    (dict(target_modules=r".*\.(q|v)_proj", layers_to_transform=[0]), LoraAdapterError,
     r"layers_to_transform and layers_pattern cannot go with a target_modules regular expression"),
    (dict(target_modules=None), LoraAdapterError, r"target_modules must be a list"),
    (dict(layers_to_transform=[5]), LoraBaseModelMismatchError, r"layers_to_transform lists layer 5, but the base "
                                                                r"model has 2 layers"),
    (dict(exclude_modules=["q_proj", "v_proj"]), LoraAdapterError, r"targets no module"),
    (dict(rank_pattern={r"model\.layers\.1\.self_attn\.q_proj": 2}), UnsupportedLoraError,
     r"rank_pattern gives model\.layers\.1\.self_attn\.q_proj 2 instead of 4"),
    (dict(alpha_pattern={"v_proj": 16}), UnsupportedLoraError, r"alpha_pattern gives .*v_proj 16 instead of 8"),
    (dict(r=2), LoraAdapterError, r"q_proj\.lora_A\.weight has shape \[4, 64\], rank 4, but adapter_config\.json "
                                  r"says r=2"),
    (dict(r=0), LoraAdapterError, r"r must be a positive integer, got 0"),
    (dict(lora_alpha="8"), LoraAdapterError, r"lora_alpha must be a number, got '8'"),
    (dict(target_modules=["v_proj"]), LoraAdapterError, r"holds tensor base_model\.model\.model\.layers\.0\."
                                                        r"self_attn\.q_proj\.lora_A\.weight, but adapter_config\.json "
                                                        r"does not target model\.layers\.0\.self_attn\.q_proj"),
    (dict(layers_to_transform=1), LoraAdapterError, r"does not target model\.layers\.0\.self_attn\.q_proj"),
]


@pytest.mark.parametrize("changes, error, message", REFUSED_SETTINGS)
def test_unsupported_or_inconsistent_settings_are_refused_naming_them(tmp_path, changes, error, message):
    _write_adapter(tmp_path, **changes)
    with pytest.raises(error, match=message):
        _load(tmp_path)


def test_rank_above_max_lora_rank_is_refused(tmp_path):
    _write_adapter(tmp_path, rank=16)
    with pytest.raises(LoraRankError, match=r"rank r=16 is above the server's max_lora_rank \(8\)"):
        _load(tmp_path)
    with pytest.raises(ConfigError, match="max_lora_rank must be at least 1"):
        _load(tmp_path, max_lora_rank=0)


@pytest.mark.parametrize("other, message", [
    (dict(hidden_size=96, head_dim=16), r"down_proj\.lora_B\.weight has shape \[96, 4\], but the base model "
                                        r"needs \[64, 4\] for it \(its down_proj weight is \[64, 160\]: "
                                        r"hidden_size 64"),
    (dict(num_key_value_heads=4), r"v_proj\.lora_B\.weight has shape \[64, 4\], but the base model needs \[32, 4\]"),
    (dict(intermediate_size=128), r"down_proj\.lora_A\.weight has shape \[4, 128\], but the base model needs "
                                  r"\[4, 160\]"),
    (dict(num_hidden_layers=3), r"layers\.2\.\S+ of layer 2, but the base model has 2 layers"),
    (dict(num_hidden_layers=1), r"holds weights up to layer 0, but the base model has 2 layers and "
                                r"adapter_config\.json targets q_proj in layer 1: the adapter was made for a model "
                                r"with fewer layers"),
])
def test_an_adapter_of_another_base_model_is_refused_naming_tensor_and_shapes(tmp_path, other, message):
    _write_adapter(tmp_path, base=dataclasses.replace(BASE, **other), projections=("q_proj", "v_proj", "down_proj"))
    with pytest.raises(LoraBaseModelMismatchError, match=message):
        _load(tmp_path)


def test_missing_folder_or_files_are_refused_naming_them(tmp_path):
    with pytest.raises(LoraAdapterError, match=r"LoRA adapter folder \S+nowhere does not exist"):
        _load(tmp_path / "nowhere")
    _write_adapter(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_CONFIG_FILE).unlink()
    with pytest.raises(LoraAdapterError, match=r"has no adapter_config\.json"):
        _load(tmp_path / "a")
    _write_adapter(tmp_path / "c" / "my-adapter")  # how peft saves an adapter not named "default"
    with pytest.raises(LoraAdapterError, match=r"has no adapter_config\.json, but its subfolders my-adapter each "
                                               r"hold one"):
        _load(tmp_path / "c")
    _write_adapter(tmp_path / "b")
    (tmp_path / "b" / ADAPTER_WEIGHTS_FILE).unlink()
    with pytest.raises(LoraAdapterError, match=r"has no adapter_model\.safetensors"):
        _load(tmp_path / "b")
    (tmp_path / "b" / "adapter_model.bin").write_bytes(b"\x80\x04 pickled")
    with pytest.raises(UnsupportedLoraError, match=r"holds adapter_model\.bin, a pickle file"):
        _load(tmp_path / "b")


def test_corrupt_files_are_refused_naming_them(tmp_path):
    _write_adapter(tmp_path)
    (tmp_path / ADAPTER_CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 4,')
    with pytest.raises(LoraAdapterError, match=r"adapter_config\.json is not a readable JSON file"):
        _load(tmp_path)
    _write_adapter(tmp_path)
    weights = tmp_path / ADAPTER_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(LoraAdapterError, match=r"adapter_model\.safetensors is not a valid safetensors file"):
        _load(tmp_path)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(LoraAdapterError, match=r"adapter_model\.safetensors is not a valid safetensors file"):
        _load(tmp_path)


@pytest.mark.parametrize("extra, error, message", [
    ({"model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(64, np.float32)}, UnsupportedLoraError,
     r"holds tensor \S+q_proj\.lora_magnitude_vector, which is no lora_A/lora_B weight"),
    ({"model.layers.0.self_attn.q_proj.lora_B.bias": np.ones(64, np.float32)}, UnsupportedLoraError,
     r"q_proj\.lora_B\.bias, which is no lora_A/lora_B weight"),
    ({"model.embed_tokens.lora_embedding_A": np.ones((4, 256), np.float32)}, UnsupportedLoraError,
     r"embed_tokens\.lora_embedding_A, which is no lora_A/lora_B weight"),
    ({"model.layers.0.mlp.q_proj.lora_A.weight": np.ones((4, 64), np.float32)}, UnsupportedLoraError,
     r"mlp\.q_proj\.lora_A\.weight, which is no lora_A/lora_B weight"),
    ({"model.layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 64), np.float32)}, LoraAdapterError,
     r"holds \S+q_proj\.lora_A\.weight and \S+q_proj\.lora_A\.weight, the same weight twice"),
    ({"model.layers.0.self_attn.k_proj.lora_A.weight": np.ones((4, 64), np.float32)}, LoraAdapterError,
     r"does not target model\.layers\.0\.self_attn\.k_proj"),
])
def test_unexpected_tensors_are_refused_naming_them(tmp_path, extra, error, message):
    tensors = _write_adapter(tmp_path)
    _rewrite_tensors(tmp_path, {**tensors, **extra})  # unprefixed names, as transformers writes them
    with pytest.raises(error, match=message):
        _load(tmp_path)


def test_a_missing_or_non_float_tensor_is_refused_naming_it(tmp_path):
    tensors = _write_adapter(tmp_path)
    name = f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"
    _rewrite_tensors(tmp_path, {key: value for key, value in tensors.items() if key != name})
    with pytest.raises(LoraAdapterError, match=rf"lacks tensor {re.escape(name)}, which adapter_config\.json "
                                               rf"targets"):
        _load(tmp_path)
    _rewrite_tensors(tmp_path, {**tensors, name: tensors[name].astype(np.int8)})
    with pytest.raises(UnsupportedLoraError, match=rf"{re.escape(name)} has dtype I8; LoRA weights must be float"):
        _load(tmp_path)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    tensors = _write_adapter(tmp_path)
    name = f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.inf
    _rewrite_tensors(tmp_path, tensors)
    with pytest.raises(LoraAdapterError, match=f"{re.escape(name)}.*NaN or infinite"):
        _load(tmp_path)


def test_a_folder_this_process_cannot_list_is_refused_not_crashed(tmp_path, monkeypatch):
    _write_adapter(tmp_path)
    (tmp_path / ADAPTER_CONFIG_FILE).unlink()  # so the loader lists the folder, looking for nested adapters

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)
    with pytest.raises(LoraAdapterError, match="cannot read LoRA adapter folder .*Permission denied"):
        _load(tmp_path)
