"""`EngineConfig`: the continuous-batching engine's settings, named as vLLM's flags, validated on creation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxserve.errors import ConfigError
from jaxserve.model.paged_kv_cache import ATTENTION_BACKENDS, resolve_attention_backend

DEFAULT_COMPILATION_CACHE = Path.home() / ".cache" / "jaxserve" / "xla"


def _auto_attention_backend() -> str:
    """What auto resolves to on this process's JAX platform: the Pallas kernel on a GPU, XLA elsewhere."""
    return resolve_attention_backend("auto", interpret=False, platform=jax.default_backend())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How big the engine grows and which of its fast paths are on."""

    max_model_len: int  # longest prompt + output of one sequence
    max_num_seqs: int = 16  # most sequences in one step
    max_num_batched_tokens: int = 512  # most tokens (decode + prefill chunks) in one step
    page_size: int = 16  # tokens per KV page (a power of two)
    num_kv_pages: int | None = None  # pages in the pool, the null page included; None: sized from memory
    kv_cache_memory_gb: float | None = None  # pool size in GiB, when num_kv_pages is None
    gpu_memory_utilization: float = 0.9  # share of device memory for weights, workspace and pool (automatic sizing)
    enable_prefix_caching: bool = True  # reuse the KV pages of shared prompt prefixes
    enable_chunked_prefill: bool = True  # split long prompts over steps
    async_scheduling: bool = True  # schedule step N+1 while the device runs step N
    static_batching: bool = False  # benchmark baseline: no new request joins until the running batch has finished
    max_tokens_policy: str = "cap"  # prompt + max_tokens beyond max_model_len: "cap" max_tokens, or "reject"
    # Which ATTENTION_BACKENDS entry attends (xla, pallas, pallas-interpret): resolved already, since the engine
    # does not choose; LLM resolves the user's auto|pallas|xla and interpret switch with resolve_attention_backend.
    attention_backend: str = dataclasses.field(default_factory=_auto_attention_backend)
    raise_on_compile: bool = True  # a compile after warm-up raises; False logs it
    compilation_cache_dir: Path | None = DEFAULT_COMPILATION_CACHE  # JAX's persistent cache; None turns it off
    seed: int = 0  # seeds the draws of requests that bring no seed

    def __post_init__(self):
        if self.max_tokens_policy not in ("cap", "reject"):
            raise ConfigError(f"max_tokens_policy must be 'cap' or 'reject', got {self.max_tokens_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be a resolved backend ({', '.join(ATTENTION_BACKENDS)}), got "
                              f"{self.attention_backend!r}; resolve_attention_backend maps auto|pallas|xla to one")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_kv_pages"):
            value = getattr(self, name)
            if name == "num_kv_pages" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
