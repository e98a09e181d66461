"""`EngineConfig`: every setting of an engine, in one frozen dataclass validated on creation.

Presets from configs/ (YAML), the command-line flags and `LLM(**kwargs)` all resolve into it, under vLLM's names
(`--max-num-seqs` is `max_num_seqs`); the scheduler and the model runner read it as it is. Some values are known
only once JAX has started, the model is loaded and the pool sized: the step limits `max_num_seqs` and
`max_num_batched_tokens` (None: the platform's defaults, vLLM's on a GPU), `max_model_len` (None: the model's own
limit) and `num_kv_pages` (None: sized from memory); `with_platform_defaults`, `with_model_limit` and `with_pool`
fill them in, and the scheduler and runner refuse a config where they are still missing.

Each field's help text is its documentation and its flag's `--help`. Imports no JAX: the command line reads it
before JAX starts.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxserve.errors import ConfigError
from jaxserve.pooler_config import MEAN_POOLING, PoolerConfig
from jaxserve.speculative_config import SpeculativeConfig

DEFAULT_COMPILATION_CACHE = str(Path.home() / ".cache" / "jaxserve" / "xla")

# How attention runs, as the runner and model name it: the plain-XLA paged attention, the Pallas kernel compiled by
# Triton for NVIDIA GPUs, or the same kernel run by Pallas' interpreter (any device, slowly).
XLA_BACKEND = "xla"
PALLAS_BACKEND = "pallas"
PALLAS_INTERPRET_BACKEND = "pallas-interpret"
# What users choose from (--attention-backend); auto picks the kernel where it compiles (a GPU), XLA elsewhere.
ATTENTION_BACKEND_CHOICES = ("auto", PALLAS_BACKEND, XLA_BACKEND)
MAX_TOKENS_POLICIES = ("cap", "reject")
# --gemm-backend: how GPU step programs compile their projection GEMMs (jaxserve/runner/compile_options.py).
GEMM_BACKENDS = ("auto", "cublas", "triton", "pallas")
QUANTIZATIONS = ("int8", "fp8")  # --quantization: weight formats of jaxserve/model/quantization.py
# --kv-cache-dtype: the model's dtype, or float8 (jaxserve/model/kv_quantization.py); fp8 is fp8_e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# --scheduling-policy, vLLM's choices: first come first served, or by each request's priority (engine/scheduler.py).
FCFS_POLICY, PRIORITY_POLICY = "fcfs", "priority"
SCHEDULING_POLICIES = (FCFS_POLICY, PRIORITY_POLICY)
# Step limits when none are given, per JAX platform: vLLM's on a GPU (256 sequences; 8192 tokens, its figure for an
# H100-class GPU), and small ones elsewhere, where every compiled step shape costs seconds of start-up.
GPU_STEP_LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
HOST_STEP_LIMITS = {"max_num_seqs": 16, "max_num_batched_tokens": 512}
# --runner, vLLM's choices: generate text, or pool each prompt's hidden states into an embedding (--convert embed).
GENERATE_RUNNER, POOLING_RUNNER = "generate", "pooling"
RUNNERS = ("auto", GENERATE_RUNNER, POOLING_RUNNER)
# --convert, vLLM's names of the ones this engine has: how a pooling runner adapts a decoder (embed: pooled final
# hidden states); vLLM's classify and reward conversions are not implemented.
EMBED_CONVERSION = "embed"
CONVERSIONS = ("auto", "none", EMBED_CONVERSION)


def _setting(default: Any, help: str, *, flag: bool = True) -> Any:
    """A field with its documentation; `flag` makes it a command-line flag (`--field-name`) as well."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What to load, how big the engine may grow, and which of its fast paths are on."""

    # What to load.
    model: str | None = _setting(None, "HF or converted Orbax folder (default: the built-in tiny random model)")
    tokenizer: str | None = _setting(None, "tokenizer folder, when not beside the weights")
    dtype: str = _setting("auto", "auto (the checkpoint's dtype on a GPU, float32 on the CPU), bfloat16, float16 "
                          "or float32")
    tensor_parallel_size: int = _setting(1, "split weights and KV cache over this many devices (default 1); must "
                                         "divide the number of attention heads")
    quantization: str | None = _setting(None, "quantize the decoder's weights as they load: int8 or fp8 "
                                        "(float8_e4m3fn), one scale per output channel (default: none); a "
                                        "pre-quantized FP8 checkpoint runs in its own format (only fp8 may be given)")

    # What the engine runs (vLLM's flags): text, or one embedding per prompt. Created, runner is generate or pooling.
    runner: str = _setting("auto", "generate (text), pooling (embeddings: /v1/embeddings and LLM.embed) or auto "
                           "(pooling with --convert embed, else generate)")
    convert: str = _setting("auto", "how the pooling runner adapts the decoder: embed (its final hidden states "
                            "pooled into one embedding per prompt) or auto (embed under --runner pooling); none "
                            "leaves the model generating")
    # str (the flag's JSON) or dict (LLM(...)) on the way in, a PoolerConfig once created; LLM resolves it against
    # the checkpoint (with_pooler), after which every field is set.
    pooler_config: str | dict | PoolerConfig | None = _setting(
        None, "the pooling runner's pooler, as vLLM's JSON: {\"pooling_type\": \"LAST\" or \"MEAN\", "
        "\"normalize\": true} (default: the checkpoint's sentence-transformers modules.json, else LAST, normalized; "
        "MEAN turns prefix caching off)")

    # Limits: they fix the compiled step shapes.
    max_model_len: int | None = _setting(None, "longest prompt + output of one sequence (default: the model's "
                                         "max_position_embeddings)")
    max_num_seqs: int | None = _setting(None, "most sequences in one step (default: 256 on a GPU, 16 elsewhere)")
    max_num_batched_tokens: int | None = _setting(None, "most tokens (decode tokens and prefill chunks) in one step "
                                                  "(default: 8192 on a GPU, 512 elsewhere)")
    block_size: int = _setting(16, "tokens per KV page (a power of two)")
    kv_cache_dtype: str = _setting("auto", "KV cache storage: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: "
                                   "float8 with a K and a V scale per layer, half of bfloat16's bytes per token")

    # The KV pool's size: explicit pages, else GiB per device, else a share of device memory.
    num_kv_pages: int | None = _setting(None, "pages in the KV pool, the null page included (default: sized from "
                                        "--kv-cache-memory-gb or device memory)")
    kv_cache_memory_gb: float | None = _setting(None, "KV pool size in GiB per device")
    gpu_memory_utilization: float = _setting(0.9, "share of each GPU's memory for weights, workspace and KV pool")

    # Fast paths, each with a switch that turns it off.
    enable_prefix_caching: bool = _setting(True, "reuse the KV pages of shared prompt prefixes")
    enable_chunked_prefill: bool = _setting(True, "split long prompts over steps")
    # How prompts share a step's token budget (vLLM's flags and defaults; engine/scheduler.py, "A step").
    max_num_partial_prefills: int = _setting(1, "chunked prefill: prompts whose prefill may advance in one step "
                                             "without finishing; above 1, each prompt's chunk is at most "
                                             "max_num_batched_tokens / (prompts prefilling, up to this many), so "
                                             "short prompts start beside long ones (default 1: a prompt may take "
                                             "the whole budget)")
    max_long_partial_prefills: int = _setting(1, "chunked prefill, with max_num_partial_prefills above 1: of those, "
                                              "how many may be long (more tokens left than "
                                              "long_prefill_token_threshold); other long prompts wait a step while "
                                              "shorter ones pass them (at most max_num_partial_prefills)")
    long_prefill_token_threshold: int = _setting(0, "chunked prefill, with max_num_partial_prefills above 1: a prompt "
                                                 "with more tokens than this left to compute is long (default 0: 4% "
                                                 "of max_model_len)")
    async_scheduling: bool = _setting(True, "schedule step N+1 while the device runs step N")
    attention_backend: str = _setting("auto", "paged attention: auto (default: pallas on a GPU, else xla), pallas "
                                      "(the Pallas kernel) or xla")
    pallas_interpret: bool = _setting(False, "run the Pallas kernel through Pallas' interpreter (slow; on any "
                                      "device, CPU included)")
    gemm_backend: str = _setting("auto", "how a GPU step program's projection GEMMs compile: auto (cublas for "
                                 "unquantized weights, triton for int8/fp8 ones), cublas (cuBLAS reading each "
                                 "layer's slice of the stacked weights in place), triton (XLA's Triton GEMM "
                                 "fusions, its default, which copy each layer's weight slices first) or pallas "
                                 "(as auto, but decode steps of up to 64 tokens multiply by int8/fp8 per-channel "
                                 "weights with a Pallas kernel that reads each layer's rows in place; one GPU, or "
                                 "any device with pallas_interpret)")

    # Speculative decoding: str (the flag's JSON) or dict (LLM(...)) on the way in, a SpeculativeConfig once created.
    speculative_config: str | dict | SpeculativeConfig | None = _setting(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m} (default: off)")

    # LoRA adapters (vLLM's flags): a request names one as its model; one batch mixes them.
    enable_lora: bool = _setting(False, "serve LoRA adapters (PEFT folders) beside the base model")
    max_loras: int = _setting(1, "LoRA adapters on the device at once: each takes a slot, and a request waits while "
                              "every slot holds another running adapter")
    max_lora_rank: int = _setting(16, "highest LoRA rank accepted; every slot is this wide")
    max_cpu_loras: int | None = _setting(None, "LoRA adapters kept read in host memory, the least recently used "
                                         "dropped (default: max_loras); more are read again from their folders")
    max_lora_wait_steps: int = _setting(1000, "steps during which requests behind one that waits for a LoRA adapter "
                                        "slot may start before it; after that none does until it has a slot",
                                        flag=False)

    # Requests.
    seed: int = _setting(0, "seeds the draws of requests that bring no seed of their own")
    scheduling_policy: str = _setting(FCFS_POLICY, "fcfs (first come, first served) or priority: requests are "
                                      "admitted, and kept when pages run out, by their `priority` (lower first, as "
                                      "in vLLM), aged so that none waits forever; under fcfs a priority other than 0 "
                                      "is refused")
    priority_aging_steps: int = _setting(1000, "priority scheduling: a request's priority improves by one level per "
                                         "this many engine steps of its age", flag=False)
    max_tokens_policy: str = _setting("cap", "prompt + max_tokens beyond max_model_len: 'cap' max_tokens, or "
                                      "'reject' the request", flag=False)
    # What one request may ask for (a larger request is refused with an error naming the field). The last three size
    # every step's sampling inputs: raising them costs host time and device memory per step.
    max_n: int = _setting(128, "continuations per prompt (n) a request may ask for (OpenAI's limit is 128)")
    max_prompts_per_request: int = _setting(2048, "prompts in one /v1/completions request (a list of prompts)")
    max_logprobs: int = _setting(20, "top log-probabilities (logprobs, top_logprobs, prompt_logprobs) a request may "
                                 "ask for; each step computes this many per row (vLLM's --max-logprobs)")
    max_logit_bias: int = _setting(300, "logit_bias entries a request may give (OpenAI accepts 300)")
    max_stop_ids: int = _setting(64, "EOS ids plus stop_token_ids a request may have (masked while min_tokens is "
                                 "unmet)")
    grammar_compile_timeout_s: float = _setting(10.0, "seconds an output constraint (schema, regex, grammar, forced "
                                                "tool calls) may take to compile; longer is a 400", flag=False)

    # Start-up and guards.
    compilation_cache_dir: str | None = _setting(DEFAULT_COMPILATION_CACHE, "JAX's persistent compilation cache; "
                                                 "None turns it off", flag=False)
    compiled_dir: str | None = _setting(None, "a store of compiled step programs (filled by `jaxserve compile --out` "
                                        "or by any start): programs kept there for this model, these settings and "
                                        "this JAX and device load whole, without tracing, lowering or compiling, and "
                                        "those compiled are added (default: programs/ in compilation_cache_dir, "
                                        "where only programs XLA compiled, not found in that cache, are added; "
                                        "'none' turns it off; flag: --compiled)", flag=False)
    raise_on_compile: bool = _setting(True, "a compile after warm-up raises; False logs it", flag=False)
    static_batching: bool = _setting(False, "benchmark baseline: no request joins until the running batch has "
                                     "finished", flag=False)

    def __post_init__(self):
        for name in ("model", "tokenizer", "compilation_cache_dir", "compiled_dir"):
            if isinstance(getattr(self, name), Path):  # folders may come as paths; the config keeps text
                object.__setattr__(self, name, str(getattr(self, name)))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), _HINTS[field.name])
        for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size", "max_logprobs",
                     "max_stop_ids", "priority_aging_steps", "max_loras", "max_lora_rank", "max_lora_wait_steps",
                     "max_n", "max_prompts_per_request", "max_num_partial_prefills", "max_long_partial_prefills"):
            if getattr(self, name) is not None:
                _check_at_least(name, getattr(self, name), 1)
        _check_at_least("max_logit_bias", self.max_logit_bias, 0)
        if self.max_cpu_loras is not None:
            _check_at_least("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        if self.enable_lora and self.speculative_config is not None:
            raise ConfigError(f"{_named('enable_lora')} and {_named('speculative_config')} do not combine yet")
        if self.max_model_len is not None:
            _check_at_least("max_model_len", self.max_model_len, 2)
        if self.num_kv_pages is not None:
            # Page 0 is the null page, so a usable pool has two at least.
            _check_at_least("num_kv_pages", self.num_kv_pages, 2)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"{_named('block_size')} must be a power of two, got {self.block_size}")
        for name in ("kv_cache_memory_gb", "grammar_compile_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{_named(name)} must be positive, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{_named('gpu_memory_utilization')} must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"{_named('quantization')} must be one of {', '.join(QUANTIZATIONS)}, got "
                              f"{self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{_named('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"{_named('scheduling_policy')} must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                              f"{self.scheduling_policy!r}")
        if self.max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ConfigError(f"max_tokens_policy must be one of {', '.join(MAX_TOKENS_POLICIES)}, got "
                              f"{self.max_tokens_policy!r}")
        self._check_attention_choice()
        self._check_gemm_backend()
        self._check_chunking()
        self._check_partial_prefills()
        self._resolve_runner()

    @property
    def max_pages_per_seq(self) -> int:
        """Block-table width: pages covering the longest sequence."""
        return -(-self.require("max_model_len") // self.block_size)

    def require(self, name: str) -> int:
        """A value filled in once JAX has started (the step limits), the model is loaded (max_model_len) or the pool
        sized (num_kv_pages)."""
        value = getattr(self, name)
        if value is None:
            raise ConfigError(f"{name} is not resolved yet: with_platform_defaults, with_model_limit and with_pool "
                              "fill it in")
        return value

    def with_platform_defaults(self, platform: str) -> EngineConfig:
        """The step limits left unset take JAX platform `platform`'s defaults ("gpu": vLLM's; else small ones)."""
        defaults = GPU_STEP_LIMITS if platform == "gpu" else HOST_STEP_LIMITS
        return dataclasses.replace(self, **{name: value for name, value in defaults.items()
                                            if getattr(self, name) is None})

    def with_model_limit(self, max_position_embeddings: int) -> EngineConfig:
        """max_model_len checked against the model's limit, or that limit when none was asked for."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=max_position_embeddings)
        if self.max_model_len > max_position_embeddings:
            raise ConfigError(f"{_named('max_model_len')} must be between 2 and the model's max_position_embeddings "
                              f"({max_position_embeddings}), got {self.max_model_len}")
        return self

    def with_pool(self, num_kv_pages: int) -> EngineConfig:
        """The config of an engine whose pool holds `num_kv_pages` pages (sized from memory when none was set)."""
        return dataclasses.replace(self, num_kv_pages=num_kv_pages)

    @property
    def pooling(self) -> bool:
        """The engine pools prompts into embeddings (--runner pooling) rather than generating text."""
        return self.runner == POOLING_RUNNER

    def with_pooler(self, checkpoint: PoolerConfig | None) -> EngineConfig:
        """A pooling engine's config with its pooler resolved: pooler_config's fields, else the checkpoint's
        (sentence-transformers files), else LAST, normalized. MEAN pooling turns prefix caching off, as vLLM does: a
        prompt found in the cache would skip its cached tokens' hidden states, which the mean needs. A generating
        engine's config is returned as it is."""
        if not self.pooling:
            return self
        pooler = (self.pooler_config or PoolerConfig()).over(checkpoint)
        return dataclasses.replace(self, pooler_config=pooler, enable_prefix_caching=self.enable_prefix_caching
                                   and pooler.pooling_type != MEAN_POOLING)

    def attention_implementation(self, platform: str) -> str:
        """The attention that runs on JAX's default backend `platform` ("gpu", "cpu", "tpu"): auto means the kernel
        where Triton compiles it (a GPU) and XLA elsewhere, and with pallas_interpret the interpreted kernel
        anywhere. The compiled kernel off a GPU is refused now rather than at compile time."""
        if self.attention_backend == XLA_BACKEND:
            return XLA_BACKEND
        if self.pallas_interpret:
            return PALLAS_INTERPRET_BACKEND
        if platform == "gpu":
            return PALLAS_BACKEND
        if self.attention_backend == PALLAS_BACKEND:
            raise ConfigError(f"the pallas attention backend compiles through Triton for NVIDIA GPUs, but JAX runs on "
                              f"{platform!r}; add pallas_interpret (--pallas-interpret) to run the kernel through "
                              f"Pallas' interpreter, or choose xla")
        return XLA_BACKEND

    def stacked_gemm(self, platform: str, packed_int4: bool = False) -> str:
        """How the step programs on `platform` multiply by layer-stacked quantized weights (model/quantization.py):
        xla, or with gemm_backend pallas the kernel, compiled on a GPU or interpreted with pallas_interpret; the
        compiled kernel off a GPU, or over several devices, is refused now rather than at compile time. Packed 4-bit
        weights (`packed_int4`), which XLA would widen in memory, take their kernel under auto on one GPU."""
        if self.gemm_backend == "auto" and packed_int4 and platform == "gpu" and self.tensor_parallel_size == 1:
            return PALLAS_BACKEND
        if self.gemm_backend != PALLAS_BACKEND:
            return XLA_BACKEND
        if self.tensor_parallel_size > 1:
            raise ConfigError(f"{_named('gemm_backend')} pallas runs its kernel on one device; with tensor parallelism "
                              "choose auto, cublas or triton")
        if self.pallas_interpret:
            return PALLAS_INTERPRET_BACKEND
        if platform != "gpu":
            raise ConfigError(f"{_named('gemm_backend')} pallas compiles its kernel through Triton for NVIDIA GPUs, but "
                              f"JAX runs on {platform!r}; add pallas_interpret (--pallas-interpret) to run it through "
                              "Pallas' interpreter, or choose auto")
        return PALLAS_BACKEND

    def _check_gemm_backend(self) -> None:
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ConfigError(f"{_named('gemm_backend')} must be one of {', '.join(GEMM_BACKENDS)}, got "
                              f"{self.gemm_backend!r}")

    def _check_attention_choice(self) -> None:
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ConfigError(f"unknown attention backend {self.attention_backend!r} "
                              f"(choose from {', '.join(ATTENTION_BACKEND_CHOICES)})")
        if self.attention_backend == XLA_BACKEND and self.pallas_interpret:
            raise ConfigError("pallas_interpret runs the Pallas kernel through Pallas' interpreter, so it does not "
                              "apply to the xla attention backend; choose auto or pallas")

    def _resolve_runner(self) -> None:
        """Settles runner auto (pooling with convert embed, as vLLM) and refuses what a pooling engine lacks."""
        for name, choices in (("runner", RUNNERS), ("convert", CONVERSIONS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{_named(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                                  + (" (vLLM's classify and reward conversions are not implemented)"
                                     if name == "convert" else ""))
        if self.runner == "auto":
            object.__setattr__(self, "runner", POOLING_RUNNER if self.convert == EMBED_CONVERSION else GENERATE_RUNNER)
        if not self.pooling:
            if self.convert == EMBED_CONVERSION or self.pooler_config is not None:
                raise ConfigError(f"{_named('convert' if self.convert == EMBED_CONVERSION else 'pooler_config')} "
                                  f"applies to the pooling runner, but runner is {self.runner}: add --runner pooling")
            return
        if self.convert == "none":
            raise ConfigError(f"{_named('runner')} pooling needs {_named('convert')} embed (or auto): the decoder "
                              "has no pooler of its own")
        for name in ("speculative_config", "enable_lora"):
            if getattr(self, name):
                raise ConfigError(f"{_named(name)} does not combine with {_named('runner')} pooling: an embedding "
                                  "request generates nothing and runs on the base model")

    def _check_chunking(self) -> None:
        # Without chunking a prompt is computed whole in one step, so the longest one must fit a step's budget.
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(f"without chunked prefill {_named('max_num_batched_tokens')} "
                              f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len})")

    def _check_partial_prefills(self) -> None:
        # vLLM's checks of the same flags (vllm/config/scheduler.py), each naming the flag.
        _check_at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError(f"{_named('max_long_partial_prefills')} ({self.max_long_partial_prefills}) must be at "
                              f"most max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            raise ConfigError(f"{_named('max_num_partial_prefills')} above 1 needs chunked prefill "
                              "(--enable-chunked-prefill)")
        if self.max_model_len is not None and self.long_prefill_token_threshold > self.max_model_len:
            raise ConfigError(f"{_named('long_prefill_token_threshold')} ({self.long_prefill_token_threshold}) must "
                              f"be at most max_model_len ({self.max_model_len})")

    @property
    def long_prefill_tokens(self) -> int:
        """Prompts with more tokens than this left to compute are long; 0: no prompt is (a single partial prefill
        takes the whole budget). vLLM's default: 4% of max_model_len once partial prefills are concurrent."""
        if self.max_num_partial_prefills == 1:
            return 0
        return self.long_prefill_token_threshold or int(self.require("max_model_len") * 0.04)


_HINTS = typing.get_type_hints(EngineConfig)
FIELD_NAMES = tuple(_HINTS)


def flag_fields() -> list[dataclasses.Field]:
    """The settings that are also command-line flags, in declaration order."""
    return [field for field in dataclasses.fields(EngineConfig) if field.metadata["flag"]]


def flag_type(name: str) -> type:
    """The type a flag's text converts to: the field's type without None."""
    return next(t for t in typing.get_args(_HINTS[name]) or (_HINTS[name],) if t is not type(None))


def load_config(config_file: Path | None, overrides: dict[str, Any]) -> EngineConfig:
    """Preset values from `config_file` (YAML), replaced by every override that is not None."""
    values = _read_preset(config_file) if config_file is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return config_from(values)


def config_from(values: dict[str, Any]) -> EngineConfig:
    """An EngineConfig of these settings; an unknown name is a ConfigError that names it."""
    unknown = [key for key in values if key not in _HINTS]
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r} (known: {', '.join(FIELD_NAMES)})")
    return EngineConfig(**values)


def _named(name: str) -> str:
    """A setting as users write it: `LLM(...)` keyword and preset key, then the flag (where it has one)."""
    return f"{name} (--{name.replace('_', '-')})"


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{_named(name)} must be at least {minimum}, got {value}")


def _check_type(name: str, value: Any, hint: Any) -> None:
    allowed = typing.get_args(hint) or (hint,)
    if isinstance(value, bool):
        ok = bool in allowed
    elif isinstance(value, int) and float in allowed:
        ok = True
    else:
        ok = isinstance(value, tuple(t for t in allowed if isinstance(t, type)))
    if not ok:
        raise ConfigError(f"setting {name!r} has the wrong type: {value!r}")


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
