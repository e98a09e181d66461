"""Engine settings: one frozen dataclass, filled from a YAML preset in configs/ and then from command-line flags."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What to load and how big the engine may grow. Names follow vLLM's flags (`--block-size` is the page size)."""

    model: str | None = None  # HF or converted Orbax folder; None means the built-in tiny random model
    tokenizer: str | None = None  # folder with tokenizer files when they are not beside the weights
    dtype: str = "auto"  # auto (checkpoint dtype on GPU, float32 on CPU), bfloat16, float16 or float32
    max_model_len: int | None = None  # longest prompt + output; None means the model's max_position_embeddings
    max_num_seqs: int = 16  # most sequences in one step
    max_num_batched_tokens: int = 512  # most tokens (decode + prefill chunks) in one step
    block_size: int = 16  # tokens per KV page
    num_kv_pages: int | None = None  # pool size in pages; None: from kv_cache_memory_gb or the device's memory
    kv_cache_memory_gb: float | None = None  # pool size in GiB
    gpu_memory_utilization: float = 0.9  # share of device memory the weights and pool may use
    enable_prefix_caching: bool = True  # reuse KV pages of shared prompt prefixes
    enable_chunked_prefill: bool = True  # split long prompts over steps
    async_scheduling: bool = True  # schedule the next step while the device runs this one
    attention_backend: str = "auto"  # paged attention: auto (pallas on a GPU, else xla), pallas or xla
    pallas_interpret: bool = False  # run the Pallas kernel through Pallas' interpreter: slow, but on any device
    tensor_parallel_size: int = 1  # devices the weights, KV heads and pool are split over (one mesh axis)
    seed: int = 0  # seeds the draws of requests that bring no seed of their own

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LLM(...)`."""
        return dataclasses.asdict(self)


_HINTS = typing.get_type_hints(EngineSettings)


def load_settings(config_file: Path | None, overrides: dict[str, Any]) -> EngineSettings:
    """Preset values from `config_file` (YAML), replaced by every override that is not None."""
    values = _read_preset(config_file) if config_file is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key, value in values.items():
        if key not in _HINTS:
            raise ConfigError(f"unknown setting {key!r} (known: {', '.join(_HINTS)})")
        if not _has_type(value, _HINTS[key]):
            raise ConfigError(f"setting {key!r} has the wrong type: {value!r}")
    return EngineSettings(**values)


def _has_type(value: Any, hint: Any) -> bool:
    allowed = typing.get_args(hint) or (hint,)
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, tuple(t for t in allowed if isinstance(t, type)))


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
