"""Token sampling on the host in numpy: the plain reference the on-device sampler (runner/sampler.py) is checked
against.

The order of operations is vLLM v1's (`vllm/v1/sample/sampler.py`):

1. log-probabilities are reported from the *raw* logits (vLLM's default `logprobs_mode="raw_logprobs"`), before any
   bias, penalty or temperature, so a request's logprobs do not depend on how it is sampled;
2. the grammar's token mask (structured output: forbidden tokens get -inf), then min_tokens masks (EOS and stop ids
   get -inf until enough tokens exist), then logit_bias;
3. penalties: repetition (prompt and output tokens), then frequency and presence (output tokens only);
4. greedy requests take the argmax here (ties go to the lowest id); the others continue:
5. temperature, then min_p, then top-k, then top-p over what min_p and top-k kept, then one draw.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.logprobs import SampledToken
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplingContext:
    """What a request has seen so far: the penalties and min_tokens depend on it."""

    prompt_ids: tuple[int, ...] = ()  # the prompt; repetition_penalty covers it
    output_ids: tuple[int, ...] = ()  # tokens generated so far; every penalty covers them
    eos_token_ids: tuple[int, ...] = ()  # the tokenizer's EOS ids; min_tokens holds them back unless ignore_eos
    # i32[ceil(vocab / 32)]: the tokens a grammar allows next, bit t of word t // 32; None allows every token
    token_mask: np.ndarray | None = None


NO_CONTEXT = SamplingContext()


def log_softmax(logits: np.ndarray) -> np.ndarray:  # f32[vocab] from f32[vocab]
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           context: SamplingContext = NO_CONTEXT) -> SampledToken:
    """Pick the next token from logits f32[vocab] by the request's rule."""
    processed = process_logits(logits, params, context)  # f64[vocab]
    if params.greedy:
        token = int(np.argmax(processed))
    else:
        probs = sampling_probs(processed, params)  # f64[vocab]
        token = int(rng.choice(len(probs), p=probs))
    return describe_token(logits, token, params.logprobs or 0)


def describe_token(logits: np.ndarray, token: int, num_top: int) -> SampledToken:
    """The token with its raw log-probability, its rank and the num_top most likely tokens (ties: lowest id first)."""
    logprobs = log_softmax(logits.astype(np.float64)).astype(np.float32)  # f32[vocab]
    top_ids = np.argsort(-logprobs, kind="stable")[:num_top]
    return SampledToken(
        token_id=token,
        logprob=float(logprobs[token]),
        rank=int((logprobs > logprobs[token]).sum()) + 1,
        top=tuple((int(i), float(logprobs[i])) for i in top_ids),
    )


def process_logits(logits: np.ndarray, params: SamplingParams, context: SamplingContext) -> np.ndarray:
    """Token mask, min_tokens mask, logit_bias and penalties applied to raw logits f32[vocab]; returns f64[vocab]."""
    out = logits.astype(np.float64)  # f64[vocab]
    vocab = len(out)
    if context.token_mask is not None:
        out[~allowed_tokens(context.token_mask, vocab)] = -np.inf
    if len(context.output_ids) < params.min_tokens:
        out[_in_vocab(min_tokens_blocked_ids(params, context.eos_token_ids), vocab)] = -np.inf
    # Like a JSON object (and vLLM's dict), a repeated id keeps its last bias; ids outside the vocabulary are ignored.
    for token, bias in dict(params.logit_bias).items():
        if token < vocab:
            out[token] += bias
    return _apply_penalties(out, params, context)


def allowed_tokens(token_mask: np.ndarray, vocab: int) -> np.ndarray:  # bool[vocab]
    """A packed mask i32[ceil(vocab / 32)] unpacked: bit t of word t // 32 set means token t is allowed."""
    return np.unpackbits(np.ascontiguousarray(token_mask, np.int32).view(np.uint8), bitorder="little")[:vocab] == 1


def min_tokens_blocked_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that would end the request, which min_tokens forbids until enough tokens exist."""
    return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_token_ids))


def _apply_penalties(logits: np.ndarray, params: SamplingParams, context: SamplingContext) -> np.ndarray:
    vocab = len(logits)
    output_counts = np.bincount(_in_vocab(context.output_ids, vocab), minlength=vocab)  # i64[vocab]
    seen = output_counts > 0  # bool[vocab]
    seen[_in_vocab(context.prompt_ids, vocab)] = True
    # Repetition (HF/vLLM rule): shrink a seen token's logit towards zero, i.e. divide if positive, else multiply.
    penalty = params.repetition_penalty
    repeated = np.where(logits > 0, logits / penalty, logits * penalty)
    logits = np.where(seen, repeated, logits)
    # OpenAI's definition: frequency per occurrence, presence once, both over generated tokens only.
    return logits - params.frequency_penalty * output_counts - params.presence_penalty * (output_counts > 0)


def sampling_probs(processed: np.ndarray, params: SamplingParams) -> np.ndarray:  # f64[vocab]
    """The distribution a non-greedy request draws from: temperature, then min_p, top-k, and top-p."""
    scaled = processed / params.temperature  # f64[vocab]
    unfiltered = _softmax(scaled)  # f64[vocab]
    keep = unfiltered >= params.min_p * unfiltered.max()  # bool[vocab]
    if params.top_k > 0:
        # Every token tied with the k-th largest logit stays, as in vLLM.
        keep &= scaled >= np.sort(scaled)[::-1][min(params.top_k, len(scaled)) - 1]
    probs = _softmax(np.where(keep, scaled, -np.inf))  # f64[vocab]
    return _softmax(np.where(probs >= _top_p_floor(probs, params.top_p), scaled, -np.inf))


def _top_p_floor(probs: np.ndarray, top_p: float) -> float:
    """The smallest probability inside the nucleus: tokens join, most likely first, while the mass before is < top_p.

    Written as vLLM does, with the mass of a token and all less likely ones (> 1 - top_p), which keeps every token of
    positive probability at top_p = 1 and always keeps the most likely token.
    """
    descending = np.sort(probs)[::-1]  # f64[vocab]
    tail_mass = np.cumsum(descending[::-1])[::-1]  # f64[vocab]
    return float(descending[max(1, np.count_nonzero(tail_mass > 1 - top_p)) - 1])


def _softmax(scaled: np.ndarray) -> np.ndarray:  # f64[vocab]
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def _in_vocab(ids, vocab: int) -> np.ndarray:  # i64[n]: the ids below vocab, in order
    ids = np.asarray(ids, dtype=np.int64)
    return ids[(ids >= 0) & (ids < vocab)]
