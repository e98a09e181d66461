"""Engine settings: one frozen dataclass, filled from a YAML preset in configs/ and then from command-line flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What to load and how big the engine may grow. Names follow vLLM's flags."""

    model: str | None = None  # HF or converted Orbax folder; None means the built-in tiny random model
    tokenizer: str | None = None  # folder with tokenizer files when they are not beside the weights
    dtype: str = "auto"  # auto (checkpoint dtype on GPU, float32 on CPU), bfloat16, float16 or float32
    max_model_len: int | None = None  # longest prompt + output; None means the model's max_position_embeddings
    max_num_seqs: int = 16  # most sequences decoded together
    seed: int = 0  # seeds the draws of requests that bring no seed of their own

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LLM(...)`."""
        return dataclasses.asdict(self)


_FIELD_TYPES = {"model": (str, type(None)), "tokenizer": (str, type(None)), "dtype": (str,),
                "max_model_len": (int, type(None)), "max_num_seqs": (int,), "seed": (int,)}


def load_settings(config_file: Path | None, overrides: dict[str, Any]) -> EngineSettings:
    """Preset values from `config_file` (YAML), replaced by every override that is not None."""
    values = _read_preset(config_file) if config_file is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key, value in values.items():
        if key not in _FIELD_TYPES:
            raise ConfigError(f"unknown setting {key!r} (known: {', '.join(_FIELD_TYPES)})")
        if not isinstance(value, _FIELD_TYPES[key]) or isinstance(value, bool):
            raise ConfigError(f"setting {key!r} has the wrong type: {value!r}")
    return EngineSettings(**values)


def _read_preset(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting: value")
    return data
