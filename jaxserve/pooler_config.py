"""`PoolerConfig`: how a pooling engine (`--runner pooling`) turns a prompt's final hidden states into one embedding,
as vLLM's `--pooler-config` spells it, and what a sentence-transformers checkpoint says of it.

A decoder served as an embedding model pools its final-norm hidden states (HF's `last_hidden_state`) one of two ways:
LAST (the last prompt token's, what decoder embedding models such as Qwen3-Embedding or e5-mistral are trained for,
and vLLM's default for a decoder converted to embeddings) or MEAN (the average over every prompt token), then
L2-normalises the vector unless told not to. A sentence-transformers checkpoint says which in `modules.json` (its
Pooling module's folder, usually `1_Pooling/config.json`, holds `pooling_mode_lasttoken` or
`pooling_mode_mean_tokens`; a Normalize module normalises); the flag's fields win over the checkpoint's, which win
over the defaults (LAST, normalised), as in vLLM.

Imports nothing of jaxserve's floors: EngineConfig reads it before JAX starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.errors import ConfigError

LAST_POOLING, MEAN_POOLING = "LAST", "MEAN"
POOLING_TYPES = (LAST_POOLING, MEAN_POOLING)
DEFAULT_POOLING_TYPE = LAST_POOLING  # vLLM's for a decoder converted to an embedding model
FLAG = "pooler_config (--pooler-config)"

# sentence-transformers' files: the module list, and the module types a decoder embedding model may list
MODULES_FILE = "modules.json"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
# The Pooling module's flags, by the pooling type each asks for; any other mode set is refused
_ST_MODES = {"pooling_mode_lasttoken": LAST_POOLING, "pooling_mode_mean_tokens": MEAN_POOLING}
# --pooler-config keys that ask for nothing when null (or false): vLLM's fields this engine has no use for
_NEUTRAL_KEYS = {"dimensions": None, "enable_chunked_processing": False, "max_embed_len": None, "task": "embed"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How prompts become embeddings; a field left None comes from the checkpoint, else from the defaults."""

    pooling_type: str | None = None  # LAST (the last prompt token's hidden state) or MEAN (the prompt's average)
    normalize: bool | None = None  # L2-normalise the pooled vector (vLLM's `normalize`, now `use_activation`)

    def __post_init__(self):
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"{FLAG}: pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                              f"{self.pooling_type!r} (vLLM's CLS, ALL and STEP pooling are not implemented)")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(f"{FLAG}: normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
        """The flag's JSON (`{"pooling_type": "MEAN", "normalize": true}`), a dict (LLM(...), a preset), or a
        PoolerConfig; `use_activation` is vLLM's newer name of `normalize`."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{FLAG} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{FLAG} must be a JSON object such as {{\"pooling_type\": \"LAST\", "
                              f"\"normalize\": true}}, got {value!r}")
        fields = dict(value)
        if "use_activation" in fields:
            activation = fields.pop("use_activation")
            if fields.get("normalize") is not None and activation is not None and fields["normalize"] != activation:
                raise ConfigError(f"{FLAG}: normalize and use_activation (its newer name) disagree")
            fields["normalize"] = activation if activation is not None else fields.get("normalize")
        for key, neutral in _NEUTRAL_KEYS.items():
            if key in fields and fields.pop(key) not in (None, neutral):
                raise ConfigError(f"{FLAG}: {key} is not supported (dimensions: the served decoder is not a "
                                  "Matryoshka model; a prompt longer than max_model_len is refused, never split)")
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"{FLAG}: unknown key {unknown[0]!r} (known: pooling_type, normalize, use_activation)")
        return cls(**fields)

    def over(self, base: PoolerConfig | None) -> PoolerConfig:
        """Every field resolved: this config's where set, else `base`'s (the checkpoint's), else the defaults."""
        base = base or PoolerConfig()
        pooling_type = self.pooling_type or base.pooling_type or DEFAULT_POOLING_TYPE
        normalize = next((n for n in (self.normalize, base.normalize) if n is not None), True)
        return PoolerConfig(pooling_type, normalize)


def sentence_transformers_pooler(model_dir: Path | None) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (`modules.json` and its Pooling module's
    config.json); None where the folder has no modules.json. A module this engine would not apply (a Dense
    projection, a pooling mode other than last-token or mean) is refused rather than left out."""
    if model_dir is None or not (Path(model_dir) / MODULES_FILE).is_file():
        return None
    model_dir = Path(model_dir)
    modules = _read_json(model_dir / MODULES_FILE)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise ConfigError(f"{model_dir / MODULES_FILE} must be a list of modules, each with its `type`")
    types = [module["type"] for module in modules]
    other = [t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if other:
        raise ConfigError(f"{model_dir / MODULES_FILE} lists {other[0]}, which this engine does not apply (it runs "
                          "the transformer, its pooling and a normalisation only)")
    pooling = next((m for m in modules if m["type"] == ST_POOLING), None)
    return PoolerConfig(
        pooling_type=_st_pooling_type(model_dir / pooling.get("path", "") / "config.json") if pooling else None,
        normalize=ST_NORMALIZE in types)


def _st_pooling_type(path: Path) -> str:
    """The pooling type a sentence-transformers Pooling module's config.json sets."""
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must be a JSON object")
    chosen = [mode for mode, value in config.items() if mode.startswith("pooling_mode_") and value is True]
    if len(chosen) != 1 or chosen[0] not in _ST_MODES:
        raise ConfigError(f"{path} sets the pooling modes {chosen or 'none'}; this engine pools by exactly one of "
                          f"{', '.join(_ST_MODES)}")
    return _ST_MODES[chosen[0]]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing (sentence-transformers' modules.json names it)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not readable JSON: {e}") from None
