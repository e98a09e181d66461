"""The decoder families jaxserve serves, each a small typed set of differences from Llama's decoder.

One parameterised decoder (model/llama.py) runs every family: what tells them apart is what transformers' modeling
code hard-wires per class (which projections carry a bias, a per-head norm on q and k) and how each reads the
sliding-window keys of config.json. Everything else (head_dim, tied embeddings, rope scaling, GQA) is read from
config.json the same way for all of them.

  LlamaForCausalLM    `attention_bias` on q/k/v/o, `mlp_bias` on the MLP; no window
  MistralForCausalLM  no biases; `sliding_window` (null: none) on every layer
  Qwen2ForCausalLM    q/k/v always biased, o_proj never; a window only with `use_sliding_window`, on the layers
                      `layer_types` marks "sliding_attention" (or, without it, layers >= `max_window_layers`)
  Qwen3ForCausalLM    `attention_bias` on q/k/v/o; RMSNorm over head_dim on each q and k head before RoPE; the
                      window as Qwen2's
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.errors import ModelLoadError, UnsupportedModelError

NO_WINDOW_RULE = "none"  # the family never has a sliding window
ALL_LAYERS_RULE = "all_layers"  # `sliding_window`, when set, applies to every layer (Mistral)
LAYER_TYPES_RULE = "layer_types"  # `use_sliding_window` turns the window on for the layers `layer_types` marks (Qwen)
SLIDING_LAYER_TYPE = "sliding_attention"  # transformers' `layer_types` entry of a windowed layer
# Config keys that change the math in ways no family here implements, with the value that leaves the math unchanged.
NEUTRAL_VALUES = {"partial_rotary_factor": 1.0, "attn_logit_softcapping": None, "final_logit_softcapping": None}


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """How one HF architecture's decoder differs from Llama's."""

    architecture: str  # the class name config.json's `architectures` lists
    model_type: str  # config.json's `model_type` for the family (used when `architectures` is absent)
    qkv_bias: bool | None  # q/k/v projections carry a bias: fixed by the family, or None: config's attention_bias
    o_proj_bias: bool | None  # o_proj carries a bias: fixed, or None: config's attention_bias
    reads_mlp_bias: bool  # the MLP's projections carry a bias when config's mlp_bias says so; else never
    qk_norm: bool  # an RMSNorm over head_dim on every query and key head, before RoPE
    window_rule: str  # how the sliding-window keys apply: NO_WINDOW_RULE, ALL_LAYERS_RULE or LAYER_TYPES_RULE


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("LlamaForCausalLM", "llama", qkv_bias=None, o_proj_bias=None, reads_mlp_bias=True, qk_norm=False,
                window_rule=NO_WINDOW_RULE),
    ModelFamily("MistralForCausalLM", "mistral", qkv_bias=False, o_proj_bias=False, reads_mlp_bias=False,
                qk_norm=False, window_rule=ALL_LAYERS_RULE),
    ModelFamily("Qwen2ForCausalLM", "qwen2", qkv_bias=True, o_proj_bias=False, reads_mlp_bias=False, qk_norm=False,
                window_rule=LAYER_TYPES_RULE),
    ModelFamily("Qwen3ForCausalLM", "qwen3", qkv_bias=None, o_proj_bias=None, reads_mlp_bias=False, qk_norm=True,
                window_rule=LAYER_TYPES_RULE),
)
SUPPORTED_ARCHITECTURES = tuple(family.architecture for family in FAMILIES)


@dataclasses.dataclass(frozen=True)
class FamilyTraits:
    """A family's differences resolved against one config.json: what the decoder builds."""

    architecture: str  # the family's HF class name
    qkv_bias: bool  # q/k/v projections carry a bias
    o_proj_bias: bool  # o_proj carries a bias
    mlp_bias: bool  # gate/up/down projections carry a bias
    qk_norm: bool  # RMSNorm per q and k head before RoPE (weights f[head_dim], shared by the heads)
    sliding_window: int | None  # keys a query of a windowed layer sees, itself included; None: no window anywhere
    windowed_layers: tuple[int, ...]  # the layers that use sliding_window, ascending (empty without a window)


def family_of(raw: dict[str, Any]) -> ModelFamily:
    """The family config.json describes, by `architectures` (or `model_type` without it); UnsupportedModelError
    naming the architecture and the supported ones otherwise."""
    architectures = raw.get("architectures") or []
    for family in FAMILIES:
        if family.architecture in architectures or (not architectures and raw.get("model_type") == family.model_type):
            return family
    named = f"architecture {', '.join(architectures)}" if architectures else f"model_type {raw.get('model_type')!r}"
    raise UnsupportedModelError(f"{named} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def family_traits(raw: dict[str, Any], family: ModelFamily, num_layers: int) -> FamilyTraits:
    """The family's differences as this config.json sets them; UnsupportedModelError naming a key that changes the
    math in a way the decoder does not implement."""
    _check_neutral_keys(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    window, layers = _sliding_window(raw, family, num_layers)
    return FamilyTraits(
        architecture=family.architecture,
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_proj_bias=attention_bias if family.o_proj_bias is None else family.o_proj_bias,
        mlp_bias=family.reads_mlp_bias and bool(raw.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        sliding_window=window,
        windowed_layers=layers,
    )


def _check_neutral_keys(raw: dict[str, Any]) -> None:
    for key, neutral in NEUTRAL_VALUES.items():
        if raw.get(key, neutral) != neutral:
            raise UnsupportedModelError(f"config key {key}={raw[key]!r} is not supported (jaxserve implements only "
                                        f"{key}={neutral!r})")


def _sliding_window(raw: dict[str, Any], family: ModelFamily, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, windowed layers) as transformers' config class for the family reads them."""
    window = raw.get("sliding_window")
    if family.window_rule == LAYER_TYPES_RULE and not raw.get("use_sliding_window", False):
        window = None
    if family.window_rule == NO_WINDOW_RULE or window is None:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"config key sliding_window must be a positive int or null, got {window!r}")
    if family.window_rule == ALL_LAYERS_RULE:
        return window, tuple(range(num_layers))
    return window, _windowed_layers(raw, num_layers)


def _windowed_layers(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers marked "sliding_attention" in `layer_types`, or, without that key, those from `max_window_layers` on."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", 28))
        return tuple(range(first, num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelLoadError(f"config key layer_types must list one type per layer ({num_layers}), got {layer_types!r}")
    unknown = sorted(set(layer_types) - {SLIDING_LAYER_TYPE, "full_attention"})
    if unknown:
        raise UnsupportedModelError(f"config key layer_types holds {', '.join(map(repr, unknown))}, which jaxserve "
                                    f"does not implement (supported: 'full_attention', '{SLIDING_LAYER_TYPE}')")
    return tuple(i for i, kind in enumerate(layer_types) if kind == SLIDING_LAYER_TYPE)
