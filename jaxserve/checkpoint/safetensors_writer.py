"""Write model folders in HF's layout: config.json plus one safetensors file, or shards and an index.

Used to export randomly initialised models (benchmarks and tests build checkpoints of any size without torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxserve.checkpoint.builtin import random_params
from jaxserve.checkpoint.model_files import CONFIG_FILE, SAFETENSORS_INDEX_FILE, SINGLE_SAFETENSORS_FILE
from jaxserve.checkpoint.param_tree import checkpoint_tensors, flat_arrays
from jaxserve.model.config import LlamaConfig
from jaxserve.model.dtypes import parse_dtype


def save_random_llama(
    folder: Path,
    hf_config: dict[str, Any],
    dtype: str = "float32",
    seed: int = 0,
    init_std: float = 0.2,
    max_shard_bytes: int | None = None,
) -> dict[str, np.ndarray]:
    """Save a randomly initialised Llama described by `hf_config` (an HF config.json dict) and return its tensors.

    `dtype` names the stored dtype and is written into config.json as `torch_dtype`.
    """
    # transformers 5 spells the field `dtype`, which would win over `torch_dtype`; keep only one.
    config = {**{key: value for key, value in hf_config.items() if key != "dtype"}, "torch_dtype": dtype}
    cfg = LlamaConfig.from_hf_dict(config)
    _, params = random_params(cfg, parse_dtype(dtype), seed, init_std)
    tensors = {name: np.ascontiguousarray(array) for name, array in checkpoint_tensors(flat_arrays(params)).items()}
    save_safetensors_folder(folder, config, tensors, max_shard_bytes)
    return tensors


def save_safetensors_folder(
    folder: Path,
    config: dict[str, Any],
    tensors: Mapping[str, np.ndarray],
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json and the tensors; with `max_shard_bytes`, split them into shards listed in an index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    if max_shard_bytes is None:
        save_file(dict(tensors), folder / SINGLE_SAFETENSORS_FILE)
        return
    shards = _split_into_shards(tensors, max_shard_bytes)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
    total_size = sum(array.nbytes for array in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2))


def _split_into_shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
    """Fill shards in order, starting a new one when the next tensor would overflow (a lone big tensor may)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name, array in tensors.items():
        if shards[-1] and shard_bytes + array.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = array
        shard_bytes += array.nbytes
    return shards
