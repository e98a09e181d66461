"""Token sampling on device: one function, jitted by its caller, picks the next token of every row of a batch.

Per-request settings travel as arrays with one row per sequence (`SamplingTensors`, built on the host in numpy), so
one compiled program serves any mix of requests. The rules and their order are those of the numpy reference in
`jaxserve/reference/host_sampler.py` (vLLM v1's order): raw log-probabilities first; min_tokens masks and
logit_bias; repetition, frequency and presence penalties; argmax for greedy rows; otherwise temperature, min_p,
top-k, top-p and one draw.

Penalties and truncation (top-k/top-p/min-p) run as masked no-ops on rows that do not use them (repetition 1,
frequency and presence 0; top_k 0, top_p 1, min_p 0), which leave a row's token exactly as if they were absent.
Truncation costs a sort of each row (half of what a sampler moves at a 128k vocabulary), so `sample(...,
truncation=False)` leaves it out: the runner uses that variant for batches where no row truncates. Penalties scatter
a token history of static width, which the runner makes one column wide (all padding) for batches where no row uses
a penalty, so that only those batches send histories as long as the context. The host fills a row's history only
where the row uses a penalty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import SamplingRow


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyTensors:
    """Repetition, frequency and presence penalties of every row."""

    history_ids: jax.Array  # i32[S, L]: each row's prompt then output ids, -1 padding
    history_is_output: jax.Array  # bool[S, L]: which history entries were generated (frequency/presence count these)
    repetition: jax.Array  # f32[S]: 1 leaves logits alone
    frequency: jax.Array  # f32[S]: subtracted per generated occurrence
    presence: jax.Array  # f32[S]: subtracted once per generated token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TruncationTensors:
    """Which tokens a non-greedy row may draw from."""

    top_k: jax.Array  # i32[S]: 0 keeps every token
    top_p: jax.Array  # f32[S]: 1 keeps every token
    min_p: jax.Array  # f32[S]: 0 keeps every token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Every row's sampling settings; rows past the real ones are padding (greedy, no bias)."""

    greedy: jax.Array  # bool[S]: argmax after biases and penalties
    temperature: jax.Array  # f32[S]: 1 on greedy rows, where it is unused
    seeds: jax.Array  # u32[S, 2]: the row's 64-bit draw seed as (high, low) words, the key jax.random.key makes of it
    steps: jax.Array  # i32[S]: folded into the row's key, so each step draws afresh
    bias_ids: jax.Array  # i32[S, B]: logit_bias token ids, -1 padding
    bias_values: jax.Array  # f32[S, B]: the bias added to each of bias_ids
    stop_ids: jax.Array  # i32[S, E]: EOS and stop token ids, -1 padding
    block_stop_ids: jax.Array  # bool[S]: fewer than min_tokens generated, so stop_ids are masked
    # i32[S, W]: tokens each row may draw, packed 32 to a word (structured output); all ones on other rows. Tokens
    # past W * 32 are allowed, so W = 1 suits batches without structured output in tests.
    allowed: jax.Array
    penalties: PenaltyTensors  # neutral on rows without a penalty
    truncation: TruncationTensors  # neutral on rows without top-k, top-p or min-p

    @property
    def num_rows(self) -> int:
        return self.greedy.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """The sampled tokens with their log-probabilities, taken from the raw logits."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: log-probability of each sampled token
    ranks: jax.Array  # i32[S]: 1 + how many tokens were more likely
    top_ids: jax.Array  # i32[S, K]: the K most likely tokens, ties lowest id first
    top_logprobs: jax.Array  # f32[S, K]


def build_sampling_tensors(rows: Sequence[SamplingRow], num_rows: int | None = None, *, bias_width: int | None = None,
                           stop_width: int | None = None, history_width: int | None = None,
                           mask_width: int | None = None) -> SamplingTensors:
    """Numpy tensors for `rows`, padded to num_rows (default len(rows)).

    A width left None is the smallest power of two that fits; pass fixed widths to keep shapes, and so compiled
    programs, the same across steps.
    """
    num_rows = len(rows) if num_rows is None else num_rows
    if num_rows < len(rows):
        raise ValueError(f"{len(rows)} rows do not fit in {num_rows}")
    pad = num_rows - len(rows)
    greedy = np.array([r.params.greedy for r in rows] + [True] * pad)
    temperature = [1.0 if r.params.greedy else r.params.temperature for r in rows]
    biases = [dict(r.params.logit_bias) for r in rows]  # a repeated id keeps its last bias, as in a JSON object
    stops = [_ids_blocked_by_min_tokens(r.params, r.eos_token_ids) for r in rows]
    bias_width = _width(max(map(len, biases), default=0), bias_width, "bias_width")
    stop_width = _width(max(map(len, stops), default=0), stop_width, "stop_width")
    return SamplingTensors(
        greedy=greedy,
        temperature=np.array(temperature + [1.0] * pad, np.float32),
        seeds=np.array([seed_words(r.seed) for r in rows] + [(0, 0)] * pad, np.uint32).reshape(-1, 2),
        steps=np.array([r.draw_step for r in rows] + [0] * pad, np.int32),
        bias_ids=_padded([list(b) for b in biases], num_rows, bias_width, -1, np.int32),
        bias_values=_padded([list(b.values()) for b in biases], num_rows, bias_width, 0.0, np.float32),
        stop_ids=_padded(stops, num_rows, stop_width, -1, np.int32),
        block_stop_ids=np.array([blocks_stop_ids(r.draw_step, r.params.min_tokens) for r in rows] + [False] * pad),
        allowed=token_masks(rows, num_rows, mask_width),
        penalties=penalty_tensors(rows, num_rows, history_width),
        truncation=_truncation_tensors(rows, num_rows),
    )


def sample(logits: jax.Array, tensors: SamplingTensors, num_top_logprobs: int,
           truncation: bool = True) -> SamplerOutput:
    """Picks one token per row of logits f32[S, V]; num_top_logprobs (K) is static. `truncation` (static) False
    leaves out top-k, top-p and min-p, which is exact where every row's are neutral (0, 1, 0)."""
    raw_logprobs, processed = target_logits(logits, tensors)  # f32[S, V] both
    drawn = _draw(processed, tensors, truncation)  # i32[S]
    token_ids = jnp.where(tensors.greedy, jnp.argmax(processed, axis=-1), drawn)  # i32[S]
    return describe_tokens(raw_logprobs, token_ids.astype(jnp.int32), num_top_logprobs)


def target_logits(logits: jax.Array, tensors: SamplingTensors) -> tuple[jax.Array, jax.Array]:
    """(raw log-probabilities, processed logits) of logits f32[S, V]: the raw ones are what logprobs report, the
    processed ones (grammar mask, min_tokens, logit_bias, penalties) what greedy rows take the argmax of and
    sampled rows temper and truncate."""
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # f32[S, V]: reported before anything changes the logits
    constrained = _apply_token_mask(logits, tensors.allowed)  # f32[S, V]
    processed = _apply_penalties(_apply_logit_bias(_apply_min_tokens(constrained, tensors), tensors),
                                 tensors.penalties)  # f32[S, V]
    return raw_logprobs, processed


def _apply_token_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:  # f32[S, V]
    """Tokens a row's grammar forbids get -inf, before anything else touches the logits."""
    rows, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[S, W, 32]
    bits = bits.reshape(rows, -1)[:, :vocab]  # i32[S, min(W * 32, V)]
    keep = jnp.pad(bits, ((0, 0), (0, vocab - bits.shape[1])), constant_values=1) != 0  # bool[S, V]
    return jnp.where(keep, logits, -jnp.inf)


def _apply_min_tokens(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:  # f32[S, V]
    # min with +inf leaves a logit alone, min with -inf masks it: one scatter serves blocked and unblocked rows.
    floor = jnp.where(tensors.block_stop_ids, -jnp.inf, jnp.inf)[:, None]  # f32[S, 1]
    floors = jnp.broadcast_to(floor, tensors.stop_ids.shape)  # f32[S, E]
    return logits.at[_row_index(tensors.stop_ids), _droppable(tensors.stop_ids, logits)].min(floors, mode="drop")


def _apply_logit_bias(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:  # f32[S, V]
    ids = _droppable(tensors.bias_ids, logits)  # i32[S, B]
    return logits.at[_row_index(ids), ids].add(tensors.bias_values, mode="drop")


def _apply_penalties(logits: jax.Array, penalties: PenaltyTensors) -> jax.Array:  # f32[S, V]
    ids = _droppable(penalties.history_ids, logits)  # i32[S, L]
    rows = _row_index(ids)  # i32[S, L]
    zeros = jnp.zeros_like(logits)  # f32[S, V]
    seen = zeros.at[rows, ids].add(1.0, mode="drop") > 0  # bool[S, V]: in the prompt or the output
    output_counts = zeros.at[rows, ids].add(penalties.history_is_output.astype(jnp.float32), mode="drop")  # f32[S, V]
    repetition = penalties.repetition[:, None]  # f32[S, 1]
    # HF/vLLM rule: a seen token's logit moves towards zero (positive divided, the rest multiplied).
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - penalties.frequency[:, None] * output_counts
    return logits - penalties.presence[:, None] * (output_counts > 0)


def _draw(processed: jax.Array, tensors: SamplingTensors, truncation: bool = True) -> jax.Array:  # i32[S]
    """A draw from softmax(processed / temperature) restricted by truncation, by the Gumbel-max trick.

    Noise is drawn over the vocabulary in id order from the row's own key, so a seeded row's tokens do not depend on
    its neighbours or its position in the batch.
    """
    scaled = tempered_logits(processed, tensors, truncation)  # f32[S, V]
    return jnp.argmax(scaled + gumbel_noise(row_keys(tensors), scaled.shape[1]), axis=-1)


def tempered_logits(processed: jax.Array, tensors: SamplingTensors,
                    truncation: bool = True) -> jax.Array:  # f32[S, V], dropped tokens -inf
    """What a sampled row draws from: softmax of these is its distribution (temperature, then truncation unless
    `truncation` is False)."""
    tempered = processed / tensors.temperature[:, None]  # f32[S, V]
    return _truncate(tempered, tensors.truncation) if truncation else tempered


def row_keys(tensors: SamplingTensors) -> jax.Array:  # key[S]
    """Each row's key for this draw: its seed's key (all 64 bits, as jax.random.key makes it of a 64-bit seed) with
    its step folded in."""
    return jax.vmap(lambda words, step: jax.random.fold_in(jax.random.wrap_key_data(words, impl="threefry2x32"),
                                                           step))(tensors.seeds, tensors.steps)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed's 64 bits (two's complement, so negative seeds too) as threefry's (high, low) key words: seeds that
    differ anywhere in their 64 bits draw differently. Below 2**32 the key is jax.random.key(seed)'s."""
    bits = seed % 2**64
    return bits >> 32, bits & 0xFFFFFFFF


def gumbel_noise(keys: jax.Array, vocab_size: int) -> jax.Array:  # f32[S, V]
    return jax.vmap(lambda key: jax.random.gumbel(key, (vocab_size,), jnp.float32))(keys)


def _truncate(scaled: jax.Array, truncation: TruncationTensors) -> jax.Array:  # f32[S, V], dropped tokens -inf
    """min_p, then top-k, then top-p over what they kept, from one descending sort of each row.

    Each rule keeps a prefix of the sorted row, so the result is a floor per row; tokens tied with the floor stay.
    A full sort rather than `lax.top_k`: the nucleus of top-p (and min_p's cut) can reach any depth of the vocabulary.
    """
    vocab = scaled.shape[1]
    descending = jnp.sort(scaled, axis=-1, descending=True)  # f32[S, V]
    # prob >= min_p * max_prob, written on logits; log(0) = -inf keeps everything.
    min_p_floor = descending[:, :1] + jnp.log(truncation.min_p)[:, None]  # f32[S, 1]
    k = jnp.where(truncation.top_k > 0, jnp.minimum(truncation.top_k, vocab), vocab)  # i32[S]
    top_k_floor = jnp.take_along_axis(descending, (k - 1)[:, None], axis=-1)  # f32[S, 1]
    kept = descending >= jnp.maximum(min_p_floor, top_k_floor)  # bool[S, V]
    probs = jax.nn.softmax(jnp.where(kept, descending, -jnp.inf), axis=-1)  # f32[S, V]
    # vLLM's form of "join while the mass before is < top_p": the mass of a token and all less likely ones > 1 - top_p.
    tail_mass = jnp.cumsum(probs[:, ::-1], axis=-1)[:, ::-1]  # f32[S, V]
    nucleus_size = jnp.sum(kept & (tail_mass > 1 - truncation.top_p[:, None]), axis=-1)  # i32[S]
    floor = jnp.take_along_axis(descending, (jnp.maximum(nucleus_size, 1) - 1)[:, None], axis=-1)  # f32[S, 1]
    return jnp.where(scaled >= floor, scaled, -jnp.inf)


def describe_tokens(raw_logprobs: jax.Array, token_ids: jax.Array, num_top: int) -> SamplerOutput:
    """Log-probability and rank of token_ids i32[S] under raw_logprobs f32[S, V], with the num_top best per row."""
    token_logprobs = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)  # f32[S, 1]
    top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, num_top)  # f32[S, K], i32[S, K]; ties: lowest id first
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=token_logprobs[:, 0],
        ranks=(jnp.sum(raw_logprobs > token_logprobs, axis=-1) + 1).astype(jnp.int32),
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_logprobs,
    )


def _droppable(ids: jax.Array, logits: jax.Array) -> jax.Array:  # i32 like ids
    """Padding (-1) becomes an out-of-range id, which scatters with mode="drop" ignore (a raw -1 would wrap)."""
    return jnp.where(ids >= 0, ids, logits.shape[1])


def _row_index(ids: jax.Array) -> jax.Array:  # i32 like ids: the row of each entry
    return jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)


def blocks_stop_ids(draw_step: int | np.ndarray, min_tokens: int | np.ndarray):  # bool, or bool[S] for i32[S]
    """min_tokens is unmet at this draw: fewer tokens than min_tokens come before it (draw_step counts the draw
    itself; the engine's live outputs hold its pending token when the arrays are built)."""
    return (min_tokens > 0) & (draw_step - 1 < min_tokens)


def _ids_blocked_by_min_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def needs_truncation(tensors: SamplingTensors) -> bool:
    """Whether a row of these (host, numpy) tensors draws its token (not greedy) from fewer than all tokens (top-k,
    top-p or min-p): the step needs the sampler that truncates, `sample(..., truncation=True)`."""
    truncation = tensors.truncation
    truncating = (truncation.top_k > 0) | (truncation.top_p < 1) | (truncation.min_p > 0)  # bool[S]
    return bool((truncating & ~tensors.greedy).any())


def penalty_tensors(rows: Sequence[SamplingRow], num_rows: int, history_width: int | None) -> PenaltyTensors:
    """A row without a penalty gets an empty history: its neutral settings ignore it, and the host skips the copy.
    `history_width` 1 suits a batch where no row uses a penalty."""
    penalised = [r.params.uses_penalties for r in rows]
    histories = [list(r.prompt_ids) + list(r.output_ids) if p else [] for r, p in zip(rows, penalised)]
    from_output = [[False] * len(r.prompt_ids) + [True] * len(r.output_ids) if p else []
                   for r, p in zip(rows, penalised)]
    width = _width(max(map(len, histories), default=0), history_width, "history_width")
    pad = num_rows - len(rows)
    return PenaltyTensors(
        history_ids=_padded(histories, num_rows, width, -1, np.int32),
        history_is_output=_padded(from_output, num_rows, width, False, np.bool_),
        repetition=np.array([r.params.repetition_penalty for r in rows] + [1.0] * pad, np.float32),
        frequency=np.array([r.params.frequency_penalty for r in rows] + [0.0] * pad, np.float32),
        presence=np.array([r.params.presence_penalty for r in rows] + [0.0] * pad, np.float32),
    )


def _truncation_tensors(rows: Sequence[SamplingRow], num_rows: int) -> TruncationTensors:
    pad = num_rows - len(rows)
    return TruncationTensors(
        top_k=np.array([max(r.params.top_k, 0) for r in rows] + [0] * pad, np.int32),
        top_p=np.array([r.params.top_p for r in rows] + [1.0] * pad, np.float32),
        min_p=np.array([r.params.min_p for r in rows] + [0.0] * pad, np.float32),
    )


def token_masks(rows: Sequence[SamplingRow], num_rows: int, width: int | None) -> np.ndarray:  # i32[S, W]
    masks = [r.token_mask for r in rows]
    width = width if width is not None else max((len(m) for m in masks if m is not None), default=1)
    out = np.full((num_rows, width), -1, np.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            out[row] = mask
    return out


def _width(needed: int, given: int | None, name: str) -> int:
    """The given width, checked, or else the smallest power of two >= needed (at least 1)."""
    if given is None:
        return 1 << max(needed - 1, 0).bit_length()
    if given < needed:
        raise ValueError(f"{name}={given} is smaller than the {needed} entries a row needs")
    return given


def _padded(lists: Sequence[Sequence], num_rows: int, width: int, fill, dtype) -> np.ndarray:  # dtype[num_rows, width]
    out = np.full((num_rows, width), fill, dtype=dtype)
    for row, values in enumerate(lists):
        out[row, : len(values)] = values
    return out
