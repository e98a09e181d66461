"""`LlamaConfig`: the decoder's hyper-parameters, read from an HF `config.json` in either key style.

One config (and one decoder) serves every supported family (model/families.py: Llama, Mistral, Qwen2, Qwen3); a
family's differences become fields here (biases, the q/k norm, the sliding window). Real Llama 3.1 repositories keep
`rope_theta` and `rope_scaling` at the top level; transformers 5 writes a `rope_parameters` dict instead. Both map
onto the same frozen dataclass, validated on creation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.errors import ModelLoadError, UnsupportedModelError
from jaxserve.model.families import SUPPORTED_ARCHITECTURES, FamilyTraits, family_of, family_traits

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "LlamaConfig", "RopeConfig", "read_config_json"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings (HF rotate-half convention)."""

    theta: float = 10000.0  # base of the geometric frequency ladder
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # context extension factor (linear and llama3)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_len / low_freq_factor are scaled fully
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_len / high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: context length the model was pre-trained on

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"config key rope_scaling (rope_type {self.rope_type!r}) is not supported (supported rope types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelLoadError(f"rope_theta and rope factor must be positive, got {self.theta} and {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelLoadError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of the decoder, as an HF config of a supported family (model/families.py) describes it."""

    vocab_size: int  # rows of the embedding table and of lm_head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (< query heads means GQA)
    head_dim: int  # width of one attention head
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm's square root
    max_position_embeddings: int = 2048  # longest context the checkpoint claims to support
    tie_word_embeddings: bool = False  # lm_head reuses the embedding table (Llama 3.2, small Qwen3)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2 always; Llama, Qwen3: attention_bias)
    o_proj_bias: bool = False  # o_proj carries a bias (Llama, Qwen3: attention_bias)
    mlp_bias: bool = False  # gate/up/down projections carry a bias
    qk_norm: bool = False  # RMSNorm over head_dim on every q and k head before RoPE (Qwen3)
    # Keys a query of a windowed layer sees, itself included (transformers' sliding_window); None: full attention
    sliding_window: int | None = None
    windowed_layers: tuple[int, ...] = ()  # the layers sliding_window applies to, ascending
    architecture: str = "LlamaForCausalLM"  # the HF class the checkpoint was saved from (its family)
    rope: RopeConfig = RopeConfig()  # rotary embedding settings
    checkpoint_dtype: str = "float32"  # dtype the weights were saved in ("bfloat16", "float16", "float32")
    bos_token_id: int | None = None  # from config.json; tokenizer files may override
    eos_token_ids: tuple[int, ...] = ()  # from config.json; generation_config.json may add more

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.sliding_window is None and self.windowed_layers:
            raise ModelLoadError("windowed_layers needs a sliding_window")
        if any(not 0 <= layer < self.num_hidden_layers for layer in self.windowed_layers):
            raise ModelLoadError(f"windowed_layers {self.windowed_layers} name layers the model does not have")

    @property
    def queries_per_kv(self) -> int:
        """Query heads that share one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), in layer order."""
        return tuple(self.sliding_window if layer in self.windowed_layers else None
                     for layer in range(self.num_hidden_layers))

    @classmethod
    def from_json_file(cls, path: Path) -> LlamaConfig:
        return cls.from_hf_dict(read_config_json(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        family = family_of(raw)
        _check_activation(raw)
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            traits = family_traits(raw, family, int(raw["num_hidden_layers"]))
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                **_trait_fields(traits),
                rope=_rope_from_hf(raw),
                checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a field of the wrong type: {e}") from None


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object of an HF config.json; `ModelLoadError` when it is missing or not JSON."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"model folder has no config.json: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} holds JSON {type(raw).__name__}, not an object")
    return raw


def _check_activation(raw: dict[str, Any]) -> None:
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"hidden_act {activation!r} is not supported (every served family uses 'silu')")


def _trait_fields(traits: FamilyTraits) -> dict[str, Any]:
    """LlamaConfig's fields of a family's resolved differences."""
    return dict(qkv_bias=traits.qkv_bias, o_proj_bias=traits.o_proj_bias, mlp_bias=traits.mlp_bias,
                qk_norm=traits.qk_norm, sliding_window=traits.sliding_window,
                windowed_layers=traits.windowed_layers, architecture=traits.architecture)


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    """Merge both config styles: top-level rope_theta/rope_scaling, or transformers 5's rope_parameters."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"config key partial_rotary_factor={params['partial_rotary_factor']!r} is not "
                                    f"supported (jaxserve rotates whole heads)")
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
