"""Random LoRA adapters written as PEFT writes them: for the built-in random model, benchmarks and tests.

`write_random_lora_adapter` writes `adapter_config.json` (peft 0.21.2's full field set for the given LoraConfig) and
`adapter_model.safetensors` (per adapted projection of each layer, `lora_A.weight` [r, in] and `lora_B.weight`
[out, r] under peft's `base_model.model.` prefix), exactly the layout `PeftModel.save_pretrained` produces;
tests/test_lora_adapter.py checks it against peft's own save, name for name and key for key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxserve.checkpoint.lora_adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, projection_shape
from jaxserve.checkpoint.lora_config import module_name
from jaxserve.model.config import LlamaConfig

PEFT_PREFIX = "base_model.model."  # peft's wrapper prefix on every tensor name
# peft 0.21.2's adapter_config.json for LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) on a
# LlamaForCausalLM, as save_pretrained writes it.
PEFT_CONFIG: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "auto_mapping": {"base_model_class": "LlamaForCausalLM",
                     "parent_library": "transformers.models.llama.modeling_llama"},
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0,
    "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
    "monteclora_config": None, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 4,
    "rank_pattern": {}, "revision": None, "target_modules": ["q_proj", "v_proj"], "target_parameters": None,
    "task_type": None, "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
    "use_rslora": False, "velora_config": None,
}


def write_random_lora_adapter(folder: Path, base: LlamaConfig, rank: int = 4,
                              projections: Sequence[str] = ("q_proj", "v_proj"), layers: Sequence[int] | None = None,
                              prefix: str = PEFT_PREFIX, dtype=np.float32, seed: int = 0,
                              **config_changes: Any) -> dict[str, np.ndarray]:
    """An adapter folder with random A (uniform +-0.3) and B (normal, std 0.5) of `rank` for `projections` of
    `layers` (default: all) of a model shaped as `base`; `config_changes` replace adapter_config.json fields.
    Returns its tensors by name."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(base.num_hidden_layers) if layers is None else layers:
        for projection in projections:
            out_features, in_features = projection_shape(base, projection)
            name = f"{prefix}{module_name(projection, layer)}"
            tensors[f"{name}.lora_A.weight"] = rng.uniform(-0.3, 0.3, (rank, in_features)).astype(dtype)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.5, (out_features, rank)).astype(dtype)
    save_file(tensors, folder / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
    config = {**PEFT_CONFIG, "r": rank, "target_modules": list(projections), **config_changes}
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return tensors
