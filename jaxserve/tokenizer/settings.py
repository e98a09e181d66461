"""`TokenizerSettings`: what a model folder says about its tokenizer outside the vocabulary file itself.

Three optional files contribute: `tokenizer_config.json` (special token strings, BOS/EOS flags, the chat template),
`chat_template.jinja` (transformers 5 saves the template there instead) and `generation_config.json` (the token ids
that end generation; Llama 3.1 lists several).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxserve.errors import TokenizerError

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class ChatTemplateSource:
    """The text of a chat template and the file it came from."""

    text: str  # Jinja source, uncompiled
    origin: str  # path of the file it was read from, named in render errors


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """Tokenizer options a model folder declares, before any lookup in the vocabulary."""

    bos_token: str | None = None  # tokenizer_config.json "bos_token" (AddedToken dicts reduced to their content)
    eos_token: str | None = None  # tokenizer_config.json "eos_token"
    # tokenizer_config.json flags, None when the file does not say. Only tokenizer.model honours them: with a
    # tokenizer.json its post-processor decides, as in transformers 5.
    add_bos_token: bool | None = None  # prepend BOS when encoding with special tokens
    add_eos_token: bool | None = None  # append EOS when encoding with special tokens
    chat_template: ChatTemplateSource | None = None  # chat_template.jinja, else tokenizer_config.json's default
    generation_bos_token_id: int | None = None  # generation_config.json "bos_token_id"
    generation_eos_token_ids: tuple[int, ...] = ()  # generation_config.json "eos_token_id", int or list


def read_tokenizer_settings(model_dir: Path) -> TokenizerSettings:
    """Read the optional tokenizer side files of `model_dir`; a present but malformed file raises TokenizerError."""
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    generation_path = model_dir / GENERATION_CONFIG_FILE
    config = _read_json_object(config_path)
    generation = _read_json_object(generation_path)
    return TokenizerSettings(
        bos_token=_token_content(config.get("bos_token"), "bos_token", config_path),
        eos_token=_token_content(config.get("eos_token"), "eos_token", config_path),
        add_bos_token=_optional_flag(config, "add_bos_token", config_path),
        add_eos_token=_optional_flag(config, "add_eos_token", config_path),
        chat_template=_chat_template_source(model_dir, config.get("chat_template"), config_path),
        generation_bos_token_id=_optional_id(generation.get("bos_token_id"), "bos_token_id", generation_path),
        generation_eos_token_ids=_id_tuple(generation.get("eos_token_id"), "eos_token_id", generation_path),
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _token_content(value: Any, key: str, path: Path) -> str | None:
    """A special token given either as a plain string or as a serialized AddedToken `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise TokenizerError(f"{path}: {key} must be a string or an object with a 'content' string")


def _optional_flag(config: dict[str, Any], key: str, path: Path) -> bool | None:
    value = config.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise TokenizerError(f"{path}: {key} must be true or false, found {value!r}")


def _optional_id(value: Any, key: str, path: Path) -> int | None:
    if value is None:
        return None
    return _id_tuple(value, key, path)[0]


def _id_tuple(value: Any, key: str, path: Path) -> tuple[int, ...]:
    """Token ids given as one int or a list of ints; bool is rejected because JSON true would pass as 1."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: {key} must be a token id or a list of token ids, found {value!r}")
    return tuple(values)


def _chat_template_source(model_dir: Path, configured: Any, config_path: Path) -> ChatTemplateSource | None:
    """The separate .jinja file wins over tokenizer_config.json, as in transformers 5."""
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    try:
        return ChatTemplateSource(text=jinja_path.read_text(encoding="utf-8"), origin=str(jinja_path))
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {jinja_path}: {e}") from None
    if configured is None:
        return None
    if isinstance(configured, str):
        return ChatTemplateSource(text=configured, origin=str(config_path))
    return ChatTemplateSource(text=_default_named_template(configured, config_path), origin=str(config_path))


def _default_named_template(templates: Any, config_path: Path) -> str:
    """Pick "default" out of the list-of-named-templates form `[{"name": ..., "template": ...}]`."""
    if not isinstance(templates, list) or not all(isinstance(t, dict) for t in templates):
        raise TokenizerError(f"{config_path}: chat_template must be a string or a list of {{name, template}} objects")
    by_name = {t.get("name"): t.get("template") for t in templates}
    template = by_name.get("default")
    if not isinstance(template, str):
        names = ", ".join(str(name) for name in by_name)
        raise TokenizerError(f"{config_path}: chat_template lists no 'default' template (found: {names})")
    return template
