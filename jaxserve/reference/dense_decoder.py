"""The dense reference decoder: a batch of requests decoded over a contiguous per-sequence KV cache.

It is deliberately simple (whole-batch prefill, one token per step, logits copied to the host, numpy sampling) and
stays as the oracle that the paged continuous-batching engine is tested against. Shapes are padded to powers of two
so a workload compiles a handful of programs, not one per prompt length. Prompt log-probabilities come from one more
forward pass over the whole prompts that keeps the logits of every position.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.engine.logprobs import SampledToken
from jaxserve.model.config import LlamaConfig
from jaxserve.reference.dense_kv_cache import DenseKVCache
from jaxserve.reference.host_sampler import SamplingContext, describe_token, sample
from jaxserve.sampling_params import SamplingParams

MIN_TOKEN_BUCKET = 16  # smallest padded prompt length


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What the decoder needs of one request."""

    prompt_ids: tuple[int, ...]  # tokens to prefill, BOS included
    params: SamplingParams  # how to pick each next token
    max_new_tokens: int  # hard cap on generated tokens (max_tokens already capped by the context)
    eos_token_ids: tuple[int, ...] = ()  # the tokenizer's EOS ids: min_tokens holds them back (unless ignore_eos)


# Called after every sampled token with (index in batch, token); returns True once that request is finished.
TokenCallback = Callable[[int, SampledToken], bool]
# Called before the first token of each request with prompt_logprobs set, with (index in batch, scores): scores[j] is
# prompt token j + 1 with its log-probability given the tokens before it, its rank and prompt_logprobs top candidates.
PromptScoresCallback = Callable[[int, list[SampledToken]], None]


class DenseDecoder:
    """Decodes batches of requests with the model's dense-cache forward pass."""

    def __init__(self, config: LlamaConfig, graphdef: nnx.GraphDef, params: nnx.State, dtype, max_batch: int,
                 seed: int = 0):
        self.config = config
        self.params = params
        self.dtype = dtype
        self.max_batch = max_batch
        self._unseeded_rng = np.random.default_rng(seed)  # draws seeds for requests that bring none
        self._forward = jax.jit(functools.partial(_forward_at, graphdef), donate_argnames="cache")
        self._all_logits = jax.jit(functools.partial(_logits_everywhere, graphdef))

    def decode(self, requests: Sequence[DecodeRequest], on_token: TokenCallback,
               on_prompt_scores: PromptScoresCallback | None = None) -> None:
        """Decodes every request to completion, `max_batch` at a time, reporting each token through on_token.

        With on_prompt_scores, the requests asking for prompt_logprobs get their prompt scored through it first.
        """
        for start in range(0, len(requests), self.max_batch):
            chunk = requests[start:start + self.max_batch]
            if on_prompt_scores is not None:
                self._score_prompts(chunk, lambda i, scores, base=start: on_prompt_scores(base + i, scores))
            self._decode_batch(chunk, lambda i, tok, base=start: on_token(base + i, tok))

    def _score_prompts(self, requests: Sequence[DecodeRequest], on_prompt_scores: PromptScoresCallback) -> None:
        """Scores the prompts of the requests asking for it, from one forward pass over every prompt of the batch."""
        scoring = [i for i, r in enumerate(requests) if r.params.prompt_logprobs is not None]
        if not scoring:
            return
        tokens, positions, _ = _prefill_inputs(requests, _bucket(len(requests), 1))
        logits = np.asarray(self._all_logits(self.params, tokens, positions,
                                             self._empty_cache(*tokens.shape)))  # f32[batch, tokens, vocab]
        for i in scoring:
            prompt, num_top = requests[i].prompt_ids, requests[i].params.prompt_logprobs
            # Position p - 1's logits predict prompt token p.
            on_prompt_scores(i, [describe_token(logits[i, p - 1], prompt[p], num_top) for p in range(1, len(prompt))])

    def _decode_batch(self, requests: Sequence[DecodeRequest], on_token: TokenCallback) -> None:
        batch = _bucket(len(requests), 1)
        lengths = np.array([len(r.prompt_ids) for r in requests])
        cache_len = _bucket(int(max(lengths + [r.max_new_tokens for r in requests])), MIN_TOKEN_BUCKET)
        rngs = [np.random.default_rng(self._request_seed(r.params)) for r in requests]
        cache = self._empty_cache(batch, cache_len)

        tokens, positions, last = _prefill_inputs(requests, batch)
        logits, cache = self._forward(self.params, tokens, positions, last, cache)
        active = np.ones(len(requests), dtype=bool)
        next_tokens = np.zeros(batch, dtype=np.int32)
        outputs: list[list[int]] = [[] for _ in requests]  # tokens sampled so far per request (penalties, min_tokens)
        while active.any():
            host_logits = np.asarray(logits)  # f32[batch, vocab]; the reference path may sync every step
            for i in np.flatnonzero(active):
                context = SamplingContext(requests[i].prompt_ids, tuple(outputs[i]), requests[i].eos_token_ids)
                token = sample(host_logits[i], requests[i].params, rngs[i], context)
                next_tokens[i] = token.token_id
                outputs[i].append(token.token_id)
                lengths[i] += 1
                done = on_token(int(i), token)
                active[i] = not done and lengths[i] < cache_len
            if not active.any():
                break
            step_positions = np.zeros(batch, dtype=np.int32)
            step_positions[: len(requests)] = lengths - 1  # the position of the token just sampled
            logits, cache = self._forward(
                self.params, jnp.asarray(next_tokens[:, None]), jnp.asarray(step_positions[:, None]),
                jnp.zeros(batch, jnp.int32), cache,
            )

    def _request_seed(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else int(self._unseeded_rng.integers(2**63))

    def _empty_cache(self, batch: int, cache_len: int) -> DenseKVCache:
        cfg = self.config
        return DenseKVCache.zeros(cfg.num_hidden_layers, batch, cache_len, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype)


def _prefill_inputs(requests: Sequence[DecodeRequest], batch: int):
    """Right-padded prompts i32[batch, tokens], their positions, and the index of each prompt's last token."""
    width = _bucket(max(len(r.prompt_ids) for r in requests), MIN_TOKEN_BUCKET)
    tokens = np.zeros((batch, width), dtype=np.int32)
    last = np.zeros(batch, dtype=np.int32)
    for i, r in enumerate(requests):
        tokens[i, : len(r.prompt_ids)] = r.prompt_ids
        last[i] = len(r.prompt_ids) - 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (batch, width))
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last)


def _forward_at(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,  # i32[batch, tokens]
    positions: jax.Array,  # i32[batch, tokens]
    last: jax.Array,  # i32[batch]: which token's logits each row wants
    cache: DenseKVCache,
) -> tuple[jax.Array, DenseKVCache]:  # f32[batch, vocab], updated cache
    model = nnx.merge(graphdef, params)
    hidden, cache = model(tokens, positions, cache)
    rows = hidden[jnp.arange(hidden.shape[0]), last]  # f[batch, hidden]
    return model.logits(rows), cache


def _logits_everywhere(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,  # i32[batch, tokens]
    positions: jax.Array,  # i32[batch, tokens]
    cache: DenseKVCache,  # empty, as long as tokens; dropped afterwards
) -> jax.Array:  # f32[batch, tokens, vocab]
    model = nnx.merge(graphdef, params)
    hidden, _ = model(tokens, positions, cache)
    return model.logits(hidden)


def _bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()
