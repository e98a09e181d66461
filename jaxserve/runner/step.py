"""The jitted engine step: embeddings → layers → logits at the sampled rows → sampler (→ prompt-token scores), or,
in a step carrying speculative drafts, logits at every draft's position → verification (runner/speculative.py).

A pure function of (weights, pool, step arrays); the pool is donated, so the KV writes happen in place.

A plain step (no penalties, prompt scores or drafts) also runs as two programs, `run_packed_forward` (layers and the
sampled rows' logits) then `run_packed_sampling` (the sampler): the host can then fill the grammar masks of
structured output while the forward pass runs, after reading back the tokens those masks follow (vLLM splits its
step the same way). `run_step` is the same computation in one program: the reference the split is tested against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.lora import LoraStack
from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, PagedKVCache
from jaxserve.model.quantization import XLA_GEMM
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.sampler import SamplerOutput, SamplingTensors, describe_tokens, sample
from jaxserve.runner.speculative import DraftArrays, VerifiedDrafts, verify_drafts

# Logits rows materialised at once when scoring prompt tokens: memory stays at tile × vocab floats for any T.
PROMPT_SCORE_TILE = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Everything one step reads besides weights and pool, padded to its bucket (T tokens, S sequence rows)."""

    token_ids: jax.Array  # i32[T]: the tokens to compute; ignored where pending_rows >= 0
    pending_rows: jax.Array  # i32[T]: row of the previous step's samples holding this token's id, or -1
    positions: jax.Array  # i32[T]: each token's position in its sequence
    metadata: PagedAttentionMetadata  # where tokens write and what they attend to
    sample_index: jax.Array  # i32[S]: the token whose logits row s samples (the last of its chunk)
    # Per-row sampling settings. In the runner's host arrays `allowed` is None (the masks travel on their own), and
    # the packed buffer of a split step's forward program carries none of it (None).
    sampling: SamplingTensors | None
    # i32[T]: the prompt token following each token, 0 where none is scored; None (another compiled variant): no
    # chunk of the step scores prompt tokens
    prompt_targets: jax.Array | None = None
    # Speculative decoding's drafts per row; None (another compiled variant): no row brings drafts
    drafts: DraftArrays | None = None
    # i32[T]: each token's LoRA adapter slot (0: none); None: the engine serves no adapters
    lora_slots: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LogitsShardings:
    """Where logits live under tensor parallelism: computed split over the vocabulary (as lm_head's rows are, so
    the weight is never gathered), then gathered whole for the sampler, only for the rows it reads."""

    computed: NamedSharding  # f32[rows, vocab] split over the vocabulary
    sampled: NamedSharding  # f32[rows, vocab] replicated


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step leaves on the device."""

    sampled: SamplerOutput  # one sampled token (with log-probabilities) per sequence row
    last_tokens: jax.Array  # i32[max_rows]: sampled ids padded to a fixed width, fed to the next step's pending tokens
    prompt_scores: SamplerOutput | None  # per token (T rows): its prompt_targets entry scored; None without targets
    drafts: VerifiedDrafts | None = None  # the accepted drafts before each row's sampled token; None without drafts


def run_packed_step(graphdef: nnx.GraphDef, params: nnx.State, pool: PagedKVCache, previous_tokens: jax.Array,
                    packed: jax.Array,  # i32[layout.size]: the step's StepArrays in one buffer, but the token masks
                    allowed: jax.Array,  # i32[S, W]: SamplingTensors.allowed, sent on its own (all ones kept on device)
                    lora: LoraStack | None,  # the adapter slots; None: no adapters
                    layout: PackedLayout,  # static: the bucket's
                    num_top_logprobs: int,  # static
                    logits_shardings: LogitsShardings | None = None,
                    stacked_gemm: str = XLA_GEMM) -> tuple[StepResult, PagedKVCache]:  # static (model/quantization.py)
    """`run_step` on inputs that arrived in one transfer (and the masks)."""
    arrays = layout.unpack(packed)
    arrays = dataclasses.replace(arrays, sampling=dataclasses.replace(arrays.sampling, allowed=allowed))
    return run_step(graphdef, params, pool, previous_tokens, arrays, num_top_logprobs, logits_shardings, lora,
                    stacked_gemm)


def run_packed_forward(graphdef: nnx.GraphDef, params: nnx.State, pool: PagedKVCache, previous_tokens: jax.Array,
                       # i32[layout.size]: (the step's SamplingTensors, its other StepArrays) in one buffer, the sampling
                       # tensors first, so that they are the buffer's first `sampling_words` words for any bucket
                       packed: jax.Array,
                       lora: LoraStack | None,  # the adapter slots; None: no adapters
                       layout: PackedLayout,  # static: the bucket's
                       sampling_words: int,  # static
                       logits_shardings: LogitsShardings | None = None,
                       stacked_gemm: str = XLA_GEMM,  # static: how quantized weights are read (model/quantization.py)
                       ) -> tuple[tuple[jax.Array, jax.Array], PagedKVCache]:
    """A plain step's first program: (f32[S, vocab], the logits of the rows to sample, whole on every device;
    i32[sampling_words], the packed sampling tensors for the second program: one transfer serves both)."""
    _, arrays = layout.unpack(packed)
    model, hidden, pool = _run_layers(graphdef, params, pool, previous_tokens, arrays, lora, stacked_gemm)
    with jax.named_scope("logits"):
        logits = _gathered_logits(model, hidden[0, arrays.sample_index], logits_shardings)  # f32[S, vocab]
    return (logits, packed[:sampling_words]), pool.without_metadata()


def run_packed_sampling(logits: jax.Array,  # f32[S, vocab]: run_packed_forward's
                        packed: jax.Array,  # i32[layout.size]: the step's SamplingTensors but the masks (the forward's)
                        allowed: jax.Array,  # i32[S, W]: SamplingTensors.allowed
                        layout: PackedLayout,  # static: of the sampling tensors of S rows
                        num_top_logprobs: int,  # static
                        max_rows: int,  # static: the width of last_tokens
                        truncation: bool = True) -> StepResult:  # static: False where no row truncates
    """A plain step's second program: the sampler on the first one's logits."""
    sampling = dataclasses.replace(layout.unpack(packed), allowed=allowed)
    with jax.named_scope("sample"):
        sampled = sample(logits, sampling, num_top_logprobs, truncation)
    return StepResult(sampled=sampled, last_tokens=_padded_tokens(sampled.token_ids, max_rows), prompt_scores=None)


def run_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    pool: PagedKVCache,  # without metadata; donated
    previous_tokens: jax.Array,  # i32[max_rows]: the previous step's last_tokens
    arrays: StepArrays,
    num_top_logprobs: int,  # static
    logits_shardings: LogitsShardings | None = None,  # None: one device, logits as computed
    lora: LoraStack | None = None,  # the adapter slots, read at arrays.lora_slots; None: no adapters
    stacked_gemm: str = XLA_GEMM,  # static: how quantized weights are read (model/quantization.py)
) -> tuple[StepResult, PagedKVCache]:
    model, hidden, pool = _run_layers(graphdef, params, pool, previous_tokens, arrays, lora, stacked_gemm)
    verified = None
    if arrays.drafts is None:
        with jax.named_scope("logits"):
            # Split over the vocabulary under tensor parallelism; gathered here, for the S sampled rows only.
            logits = _gathered_logits(model, hidden[0, arrays.sample_index], logits_shardings)  # f32[S, vocab]
        with jax.named_scope("sample"):
            sampled = sample(logits, arrays.sampling, num_top_logprobs)
    else:
        with jax.named_scope("logits"):
            index = arrays.drafts.logits_index.reshape(-1)  # i32[S * (K + 1)]
            logits = _gathered_logits(model, hidden[0, index], logits_shardings)  # f32[S * (K + 1), vocab]
        with jax.named_scope("verify_drafts"):
            sampled, verified = verify_drafts(logits, arrays.drafts, arrays.sampling, num_top_logprobs)
    last_tokens = _padded_tokens(sampled.token_ids, previous_tokens.shape[0])
    prompt_scores = None
    if arrays.prompt_targets is not None:
        with jax.named_scope("prompt_scores"):
            prompt_scores = score_next_tokens(model, hidden[0], arrays.prompt_targets, num_top_logprobs,
                                              logits_shardings)
    return (StepResult(sampled=sampled, last_tokens=last_tokens, prompt_scores=prompt_scores, drafts=verified),
            pool.without_metadata())


def _run_layers(graphdef: nnx.GraphDef, params: nnx.State, pool: PagedKVCache, previous_tokens: jax.Array,
                arrays: StepArrays, lora: LoraStack | None,
                stacked_gemm: str = XLA_GEMM) -> tuple[LlamaForCausalLM, jax.Array, PagedKVCache]:
    """The model, the final hidden states f[1, T, hidden] of the step's tokens and the pool they were written to."""
    model = nnx.merge(graphdef, params)
    tokens = jnp.where(arrays.pending_rows >= 0, previous_tokens[jnp.maximum(arrays.pending_rows, 0)],
                       arrays.token_ids)  # i32[T]
    with jax.named_scope("layers"):
        step_pool = pool.with_metadata(arrays.metadata, arrays.positions, model.config.num_attention_heads)
        hidden, pool = model(tokens[None], arrays.positions[None], step_pool, lora, arrays.lora_slots, stacked_gemm)
    return model, hidden, pool


def _padded_tokens(token_ids: jax.Array, max_rows: int) -> jax.Array:  # i32[max_rows]
    """Sampled ids i32[S] padded to a fixed width: the next step's pending tokens read them by row."""
    return jnp.zeros(max_rows, jnp.int32).at[: token_ids.shape[0]].set(token_ids)


def score_next_tokens(
    model: LlamaForCausalLM,
    hidden: jax.Array,  # f[T, hidden]: final hidden states of every token of the step
    targets: jax.Array,  # i32[T]: the token to score after each one
    num_top: int,  # static: K
    logits_shardings: LogitsShardings | None = None,  # None: one device, logits as computed
) -> SamplerOutput:  # T rows: each target's raw log-probability and rank, and the top K
    """Raw log-probabilities of every token's successor, tile by tile so that no f32[T, vocab] is ever whole."""
    tile = min(hidden.shape[0], PROMPT_SCORE_TILE)  # T and the tile are powers of two: tiles cover T exactly
    tiles = (hidden.reshape(-1, tile, hidden.shape[-1]), targets.reshape(-1, tile))  # f[T/tile, tile, hidden], i32

    def score_tile(tile_inputs: tuple[jax.Array, jax.Array]) -> SamplerOutput:
        rows, ids = tile_inputs  # f[tile, hidden], i32[tile]
        logprobs = jax.nn.log_softmax(_gathered_logits(model, rows, logits_shardings), axis=-1)  # f32[tile, vocab]
        return describe_tokens(logprobs, ids, num_top)

    scored = jax.lax.map(score_tile, tiles)  # leaves [T/tile, tile, ...]
    return jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[2:]), scored)


def _gathered_logits(
    model: LlamaForCausalLM,
    hidden: jax.Array,  # f[rows, hidden]
    shardings: LogitsShardings | None,
) -> jax.Array:  # f32[rows, vocab], whole on every device
    if hidden.shape[0] == 1:
        # One row is a vector-matrix product, which cuBLAS runs on a float32 copy of the whole head (2 GB at
        # Llama-3's vocabulary, every step); two rows are a matrix product over the weight as it is.
        return _gathered_logits(model, jnp.concatenate([hidden, hidden]), shardings)[:1]
    logits = model.logits(hidden)
    if shardings is None:
        return logits
    # Without the first constraint XLA may gather the f[vocab, hidden] weight instead, every step.
    logits = jax.lax.with_sharding_constraint(logits, shardings.computed)
    return jax.lax.with_sharding_constraint(logits, shardings.sampled)
