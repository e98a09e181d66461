"""Token sampling on the host in numpy: the plain reference the on-device sampler is checked against."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class SampledToken:
    """One sampled token and the log-probabilities reported with it."""

    token_id: int  # the chosen token
    logprob: float  # its log-probability under the unmodified distribution
    rank: int  # 1 + how many tokens were more likely
    top: tuple[tuple[int, float], ...]  # (id, logprob) of the most likely tokens, as many as requested


def log_softmax(logits: np.ndarray) -> np.ndarray:  # f32[vocab] from f32[vocab]
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> SampledToken:
    """Pick the next token from logits f32[vocab] by the request's rule."""
    logprobs = log_softmax(logits.astype(np.float64)).astype(np.float32)  # f32[vocab]
    token = int(np.argmax(logits)) if params.greedy else _draw(logits, params, rng)
    top_n = params.logprobs or 0
    top_ids = np.argsort(-logprobs, kind="stable")[:top_n]
    return SampledToken(
        token_id=token,
        logprob=float(logprobs[token]),
        rank=int((logprobs > logprobs[token]).sum()) + 1,
        top=tuple((int(i), float(logprobs[i])) for i in top_ids),
    )


def _draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    probs = _filtered_probs(logits.astype(np.float64) / params.temperature, params)  # f64[vocab]
    return int(rng.choice(len(probs), p=probs))


def _filtered_probs(scaled: np.ndarray, params: SamplingParams) -> np.ndarray:  # f64[vocab]
    """Softmax restricted to the top-k tokens, then to the smallest prefix reaching top_p."""
    order = np.argsort(-scaled, kind="stable")
    keep = len(order) if params.top_k <= 0 else min(params.top_k, len(order))
    sorted_probs = np.exp(scaled[order[:keep]] - scaled[order[0]])
    sorted_probs /= sorted_probs.sum()
    # Keep tokens while the mass before them is below top_p: the first token always survives.
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    sorted_probs = np.where(mass_before < params.top_p, sorted_probs, 0.0)
    probs = np.zeros_like(scaled)
    probs[order[:keep]] = sorted_probs / sorted_probs.sum()
    return probs
