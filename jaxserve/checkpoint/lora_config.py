"""A PEFT adapter's adapter_config.json, checked and resolved against the base model: its rank, its scaling, and which
decoder projections of which layers it adapts.

Which modules an adapter adapts follows PEFT's own rules (peft 0.21, `check_target_module_exists`), applied to a
Llama's module names (`model.layers.3.self_attn.q_proj`, `model.embed_tokens`, `lm_head`, ...):
  - `target_modules` as a list: an entry matches the module of exactly that name or whose name ends in "." + entry
    (PEFT's own save writes short names, "q_proj", or, for "all-linear", every full name); as a string: a regular
    expression matching the whole name; the string "all-linear": every projection, lm_head excluded.
  - `exclude_modules`, matched the same way, takes modules out again.
  - `layers_to_transform` (list targets only) keeps the modules of those layers; `layers_pattern` names the layer
    list ("layers" in a Llama).
  - `rank_pattern` / `alpha_pattern` give modules their own rank or alpha (a key matches a name's end as a regular
    expression); refused unless they change nothing for the modules adapted, since every module of an adapter shares
    one rank and one scaling here.

Refused, naming the setting: another PEFT method than LORA; LoRA variants (DoRA, aLoRA, QALoRA, BD-LoRA, KaSA,
MonteCLoRA, VeLoRA, Arrow); trained biases (`bias`, `lora_bias`); trained copies of modules (`modules_to_save`) or of
token embeddings (`trainable_token_indices`); `target_parameters`; `layer_replication`; initialisations that change
the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: such an adapter runs only on its own residual base model);
targets outside the seven decoder projections (embed_tokens, lm_head, norms: UnsupportedLoraError) or missing from
a Llama (fc1: LoraBaseModelMismatchError). `base_model_name_or_path` is only reported: a model may be served under
any name. `fan_in_fan_out` is ignored as PEFT ignores it for linear layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxserve.errors import LoraAdapterError, LoraBaseModelMismatchError, LoraRankError, UnsupportedLoraError
from jaxserve.model.config import LlamaConfig

# The decoder projections an adapter may adapt -> the block holding each in a layer, in the order they run.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Other modules of a Llama with weights, which LoRA could target but jaxserve does not adapt.
_OTHER_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
_OTHER_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm")
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output projection

# Settings that turn on a LoRA variant or train more than LoRA's A and B; any truthy value is refused.
_UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA (use_dora), whose magnitude vectors renormalise every adapted weight",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "kasa_config": "KaSA (kasa_config), which also truncates the base weights",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "velora_config": "VeLoRA (velora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "lora_bias": "a trained bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained copies of base modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters)",
    "layer_replication": "a replicated layer stack (layer_replication)",
}
# init_lora_weights values after which the adapter's B @ A is all the change (B is zero or the adapter is trained
# from its own random start); every other value also rewrote the base weights.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What adapter_config.json says about a LoRA adapter, resolved against the base model."""

    rank: int  # r: rows of every lora_A, columns of every lora_B
    scaling: float  # multiplies B @ A: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (as PEFT computes it)
    # projection (q_proj ... down_proj) -> the layers whose projection the adapter adapts, ascending; projections it
    # leaves alone are absent; in PROJECTIONS order
    targets: Mapping[str, tuple[int, ...]]
    base_model_name_or_path: str | None  # the model it was trained on as its trainer named it (informational)


def module_name(projection: str, layer: int) -> str:
    """The base model's name of a projection in a layer, as PEFT matches it: `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{PROJECTIONS[projection]}.{projection}"


def read_lora_settings(config_file: Path, config: LlamaConfig, max_lora_rank: int) -> LoraSettings:
    """The settings of adapter_config.json after every check the module docstring lists: LoraAdapterError (or a
    subclass) naming the file and the setting at fault."""
    raw = _read_json(config_file)
    where = str(config_file)
    if raw.get("peft_type") != "LORA":
        raise UnsupportedLoraError(f"{where} has peft_type {raw.get('peft_type')!r}; jaxserve serves LoRA adapters "
                                   f"(peft_type 'LORA') only")
    _refuse_unsupported(raw, where)
    rank, alpha = _rank_and_alpha(raw, where, max_lora_rank)
    targeted = _targeted_modules(raw, config, where)
    _check_patterns(raw, where, targeted, rank, alpha)
    targets = {projection: tuple(layer for layer in range(config.num_hidden_layers)
                                 if module_name(projection, layer) in targeted) for projection in PROJECTIONS}
    base = raw.get("base_model_name_or_path")
    return LoraSettings(rank=rank, scaling=_scaling(alpha, rank, raw.get("use_rslora", False), where),
                        targets={projection: layers for projection, layers in targets.items() if layers},
                        base_model_name_or_path=None if base is None else str(base))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"LoRA adapter folder {path.parent} has no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraAdapterError(f"{path} is not a readable JSON file: {e}") from None
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"{path} holds JSON {type(raw).__name__}, not an object")
    return raw


def _refuse_unsupported(raw: Mapping[str, Any], where: str) -> None:
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if raw.get(key):
            raise UnsupportedLoraError(f"{where} sets {key}={raw[key]!r}: {what} is not supported; jaxserve serves "
                                       f"plain LoRA on the decoder projections (where peft can merge the adapter into "
                                       f"the model, merge_and_unload, serve the merged model instead)")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise UnsupportedLoraError(f"{where} sets bias={bias!r}: adapters that train the base model's biases are not "
                                   f"supported (bias 'none' only)")
    init = raw.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise UnsupportedLoraError(
            f"{where} sets init_lora_weights={init!r}: such an initialisation also changes the base model's weights, "
            f"so the adapter runs only on that changed model; convert it to a plain LoRA adapter (peft's "
            f"save_pretrained(..., path_initial_model_for_weight_conversion=...)) and load that")


def _rank_and_alpha(raw: Mapping[str, Any], where: str, max_lora_rank: int) -> tuple[int, float]:
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_lora_rank:
        raise LoraRankError(f"{where}: the adapter's rank r={rank} is above the server's max_lora_rank "
                            f"({max_lora_rank}); start the server with a max_lora_rank of at least {rank}")
    return rank, float(alpha)


def _scaling(alpha: float, rank: int, rslora: Any, where: str) -> float:
    """PEFT's `LoraLayer.update_layer`: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
    if not isinstance(rslora, bool):
        raise LoraAdapterError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _targeted_modules(raw: Mapping[str, Any], config: LlamaConfig, where: str) -> set[str]:
    """The base model's module names the adapter adapts, by PEFT's rules; refused when any is not a decoder
    projection, when an entry of target_modules names nothing in a Llama, or when nothing is left."""
    names = _module_names(config)
    spec = raw.get("target_modules")
    layers = _layers_to_transform(raw.get("layers_to_transform"), config, where)
    if spec == ALL_LINEAR:
        spec = list(PROJECTIONS)
    if isinstance(spec, str):
        if layers is not None or raw.get("layers_pattern"):
            raise LoraAdapterError(f"{where}: layers_to_transform and layers_pattern cannot go with a target_modules "
                                   f"regular expression (PEFT refuses the combination too)")
        matches = _regex_matcher(spec, "target_modules", where)
        targeted = {name for name in names if matches(name)}
        entries = {spec: targeted}
    elif isinstance(spec, list) and all(isinstance(entry, str) for entry in spec):
        entries = {entry: {name for name in names if _list_matches(entry, name)} for entry in spec}
        targeted = set().union(*entries.values())
        if layers is not None:
            patterns = _layers_pattern(raw.get("layers_pattern"), where)
            targeted = {name for name in targeted if _layer_index(name, patterns) in layers}
    else:
        raise LoraAdapterError(f"{where}: target_modules must be a list of module names or a regular expression, "
                               f"got {spec!r}")
    for entry, matched in entries.items():
        if not matched:
            raise LoraBaseModelMismatchError(
                f"{where}: target_modules entry {entry!r} matches no module of the base model (a Llama with "
                f"{config.num_hidden_layers} layers, whose projections are {', '.join(PROJECTIONS)}): the adapter was "
                f"made for another model")
    targeted -= _excluded(raw.get("exclude_modules"), targeted, where)
    projections = {module_name(projection, layer) for projection in PROJECTIONS
                   for layer in range(config.num_hidden_layers)}
    for name in sorted(targeted - projections):
        raise UnsupportedLoraError(f"{where}: target_modules reaches {name}; LoRA on it is not supported, jaxserve "
                                   f"adapts only the decoder projections ({', '.join(PROJECTIONS)})")
    if not targeted:
        raise LoraAdapterError(f"{where}: the adapter targets no module (target_modules {raw.get('target_modules')!r} "
                               f"less exclude_modules and outside layers_to_transform leaves none)")
    return targeted


def _module_names(config: LlamaConfig) -> list[str]:
    """Every module of a Llama with weights, which is what PEFT can target."""
    per_layer = [f"model.layers.{layer}.{suffix}" for layer in range(config.num_hidden_layers)
                 for suffix in _OTHER_LAYER_MODULES]
    projections = [module_name(projection, layer) for layer in range(config.num_hidden_layers)
                   for projection in PROJECTIONS]
    return projections + per_layer + list(_OTHER_MODULES)


def _list_matches(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _regex_matcher(pattern: str, key: str, where: str) -> Callable[[str], bool]:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise LoraAdapterError(f"{where}: {key} {pattern!r} is not a valid regular expression: {e}") from None
    return lambda name: compiled.fullmatch(name) is not None


def _excluded(spec: Any, names: set[str], where: str) -> set[str]:
    """The names `exclude_modules` takes out: matched as target_modules are (a list of names or a regex)."""
    if not spec:
        return set()
    if isinstance(spec, str):
        matches = _regex_matcher(spec, "exclude_modules", where)
        return {name for name in names if matches(name)}
    if isinstance(spec, list) and all(isinstance(entry, str) for entry in spec):
        return {name for name in names if any(_list_matches(entry, name) for entry in spec)}
    raise LoraAdapterError(f"{where}: exclude_modules must be a list of module names or a regular expression, "
                           f"got {spec!r}")


def _layers_to_transform(value: Any, config: LlamaConfig, where: str) -> frozenset[int] | None:
    """The layers `layers_to_transform` keeps (one index or a list); None for every layer (also for [], as PEFT
    reads it)."""
    if value is None or value == []:
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(layer, int) and not isinstance(layer, bool)
                                               for layer in layers):
        raise LoraAdapterError(f"{where}: layers_to_transform must be a layer index or a list of them, got {value!r}")
    for layer in layers:
        if not 0 <= layer < config.num_hidden_layers:
            raise LoraBaseModelMismatchError(f"{where}: layers_to_transform lists layer {layer}, but the base model "
                                             f"has {config.num_hidden_layers} layers: the adapter was made for "
                                             f"another model")
    return frozenset(layers)


def _layers_pattern(value: Any, where: str) -> tuple[str, ...]:
    if not value:
        return ()
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list) or not all(isinstance(pattern, str) for pattern in patterns):
        raise LoraAdapterError(f"{where}: layers_pattern must be a name or a list of names, got {value!r}")
    return tuple(patterns)


def _layer_index(name: str, patterns: tuple[str, ...]) -> int | None:
    """PEFT's layer index of a module name: the first number after a layer list (named by `patterns`, or any)."""
    regexes = [rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\." for pattern in patterns] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    match = next(filter(None, (re.match(regex, name) for regex in regexes)), None)
    return None if match is None else int(match.group("idx"))


def _check_patterns(raw: Mapping[str, Any], where: str, targeted: set[str], rank: int, alpha: float) -> None:
    """rank_pattern and alpha_pattern may only repeat r and lora_alpha for the modules adapted: one rank and one
    scaling per adapter is what the device side holds."""
    for key, default in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        pattern = raw.get(key) or {}
        if not isinstance(pattern, dict):
            raise LoraAdapterError(f"{where}: {key} must be an object, got {pattern!r}")
        for name in sorted(targeted):
            value = _pattern_value(pattern, name, default, key, where)
            if value != default:
                raise UnsupportedLoraError(
                    f"{where}: {key} gives {name} {value} instead of {default}; per-module ranks and alphas are not "
                    f"supported (every module of an adapter shares r and lora_alpha)")


def _pattern_value(pattern: Mapping[str, Any], name: str, default: float, key: str, where: str) -> Any:
    """PEFT's `get_pattern_key`: the value of the first key matching the end of `name` as a regular expression."""
    for entry, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({entry})$", name):
                return value
        except re.error as e:
            raise LoraAdapterError(f"{where}: {key} key {entry!r} is not a valid regular expression: {e}") from None
    return default
