"""Where things live in a model folder: config, tokenizer files, safetensors weights, a converted Orbax checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.errors import ModelLoadError

CONFIG_FILE = "config.json"
SINGLE_SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
ORBAX_SUBDIR = "orbax"

# Everything besides weights that serving needs; conversion copies these next to the Orbax checkpoint.
SIDECAR_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# Orbax writes into a folder with this infix and renames it only once the save has committed.
_ORBAX_UNFINISHED_MARKER = ".orbax-checkpoint-tmp"


def check_model_dir(model_dir: Path) -> None:
    """Raise `ModelLoadError` unless `model_dir` is an existing folder."""
    if not model_dir.exists():
        raise ModelLoadError(f"model folder does not exist: {model_dir}")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model path is not a folder: {model_dir}")


def orbax_dir(model_dir: Path) -> Path:
    """Where a converted checkpoint lives inside a model folder."""
    return model_dir / ORBAX_SUBDIR


def has_orbax_checkpoint(model_dir: Path) -> bool:
    """True when the folder holds a converted (committed) Orbax checkpoint; `load_model` then prefers it."""
    return orbax_dir(model_dir).is_dir()


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: every shard the index names, or the single file.

    Raises `ModelLoadError` when the folder has no weights or its index names a shard that is not there.
    """
    index_path = model_dir / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        return _shards_from_index(index_path)
    single = model_dir / SINGLE_SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise ModelLoadError(_no_weights_message(model_dir))


def _shards_from_index(index_path: Path) -> list[Path]:
    """The shards in the index's weight_map. Which tensor sits in which shard is read from the shards themselves."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index_path} is not a valid safetensors index (needs a weight_map): {e}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path} has an empty or malformed weight_map")
    shards = sorted({index_path.parent / str(file) for file in weight_map.values()})
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"{index_path} names shard {shard.name}, which is missing from {index_path.parent}")
    return shards


def _no_weights_message(model_dir: Path) -> str:
    message = (
        f"no weights in {model_dir}: expected {SINGLE_SAFETENSORS_FILE}, {SAFETENSORS_INDEX_FILE} "
        f"or a converted checkpoint in {ORBAX_SUBDIR}/"
    )
    if any(model_dir.glob(f"{ORBAX_SUBDIR}{_ORBAX_UNFINISHED_MARKER}*")):
        return f"{message}; a conversion into this folder did not finish, run it again"
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        return f"{message}; found PyTorch weights, which jaxserve does not read (re-save them as safetensors)"
    return message
