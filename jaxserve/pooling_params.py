"""`PoolingParams`: what one embedding request asks of a pooling engine, under vLLM's names; validated on creation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.errors import InvalidRequestError

TRUNCATION_SIDES = ("left", "right")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """Per-request settings of an embedding: truncation, normalisation, priority."""

    # Keep only this many prompt tokens (the last ones, or the first with truncation_side "right"); -1: as many as
    # max_model_len holds; None: the whole prompt, which must fit max_model_len
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"  # which end truncate_prompt_tokens cuts: left keeps the last tokens (vLLM's rule)
    # Shorter (Matryoshka) embeddings: refused by the engine, whose decoder is not trained for them; None: full size
    dimensions: int | None = None
    use_activation: bool | None = None  # L2-normalise the embedding; None: the engine's pooler_config decides
    # vLLM's older name for use_activation, keyword only; moved into use_activation on creation, so it reads None
    normalize: bool | None = dataclasses.field(default=None, kw_only=True)
    priority: int = 0  # scheduling priority, lower first; other than 0 only under --scheduling-policy priority

    def __post_init__(self):
        if self.normalize is not None:
            if self.use_activation is not None and self.use_activation != self.normalize:
                raise InvalidRequestError("normalize and use_activation (its newer name) disagree",
                                          param="use_activation")
            object.__setattr__(self, "use_activation", self.normalize)
            object.__setattr__(self, "normalize", None)
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not _is_int(truncate) or (truncate < 1 and truncate != -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (max_model_len) or a positive integer, "
                                      f"got {truncate!r}", param="truncate_prompt_tokens")
        if self.truncation_side not in TRUNCATION_SIDES:
            raise InvalidRequestError(f"truncation_side must be left or right, got {self.truncation_side!r}",
                                      param="truncation_side")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                      param="dimensions")
        for name in ("use_activation",):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean", param=name)
        if not _is_int(self.priority):
            raise InvalidRequestError(f"priority must be an integer, got {self.priority!r}", param="priority")

    def with_priority(self, priority: int | None) -> PoolingParams:
        """These params with `priority` (vLLM's keyword beside the params); None keeps their own."""
        return self if priority is None else dataclasses.replace(self, priority=priority)

    def truncated(self, token_ids: Sequence[int], max_model_len: int) -> tuple[int, ...]:
        """The prompt as the engine runs it: cut to truncate_prompt_tokens (-1: max_model_len) where asked."""
        ids = tuple(token_ids)
        if self.truncate_prompt_tokens is None:
            return ids
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep:] if self.truncation_side == "left" else ids[:keep]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
