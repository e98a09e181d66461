"""Results of generation and of pooling (embeddings), shaped like vLLM's `RequestOutput`, `PoolingRequestOutput` and
`EmbeddingRequestOutput` so evaluation scripts read them unchanged."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Logprob:
    """Log-probability of one candidate token at one position."""

    logprob: float  # natural log of the model's probability (before temperature and filtering)
    rank: int  # 1 for the most likely token
    decoded_token: str  # the token's text on its own


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One generated continuation of a prompt."""

    index: int  # which of the request's continuations this is
    text: str  # detokenized output, stop string and stop tokens excluded
    token_ids: tuple[int, ...]  # generated ids, including a stop token that ended generation
    cumulative_logprob: float | None  # sum of the sampled tokens' log-probabilities when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None  # per generated token: top-k candidates plus the sampled token
    finish_reason: str | None  # "stop" (EOS, stop token or stop string) or "length" (max_tokens or context end)
    stop_reason: int | str | None  # the stop token id or stop string that matched; None for EOS and length


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """Everything returned for one prompt."""

    request_id: str  # caller-visible id, in submission order
    prompt: str | None  # the prompt text, when the prompt was given as text
    prompt_token_ids: tuple[int, ...]  # the tokens the model saw, BOS included
    outputs: list[CompletionOutput]  # the continuations, one per SamplingParams.n
    finished: bool  # always True for offline results
    # With prompt_logprobs: per prompt token, None for the first (nothing predicts it), then the token's own
    # log-probability given the tokens before it, plus that many top candidates; None when not asked for
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(frozen=True)
class CompletionDelta:
    """What one step added to one continuation of a streaming request."""

    request_id: str  # the caller's id of the request
    index: int  # which of the request's continuations grew
    text: str  # text released by this step; empty while a possible stop string is held back
    token_ids: tuple[int, ...]  # the tokens this step generated for the continuation
    logprobs: list[dict[int, Logprob]] | None  # per new token: its candidates, when logprobs were asked for
    finish_reason: str | None  # set on the continuation's last delta: "stop" or "length"
    stop_reason: int | str | None  # the stop token id or stop string that matched, on the last delta
    # On a continuation's first delta, when prompt_logprobs were asked for: the prompt's entries as in
    # RequestOutput.prompt_logprobs (streamed echo with logprobs starts with them); None otherwise
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclasses.dataclass(frozen=True)
class PoolingOutput:
    """A pooling engine's result for one prompt (vLLM's PoolingOutput, its `data` a numpy array here)."""

    data: np.ndarray  # f32[hidden_size]: the pooled final hidden states, normalised where the request asked


@dataclasses.dataclass(frozen=True)
class PoolingRequestOutput:
    """Everything a pooling engine returns for one prompt (vLLM's PoolingRequestOutput)."""

    request_id: str  # caller-visible id
    outputs: PoolingOutput  # the pooled vector
    prompt_token_ids: tuple[int, ...]  # the tokens pooled (after truncate_prompt_tokens)
    finished: bool  # always True: a prompt is pooled whole
    prompt: str | None = None  # the prompt text, when the prompt was given as text


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    """One embedding, as vLLM's `LLM.embed` returns it."""

    embedding: list[float]  # the vector, as Python floats

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's EmbeddingRequestOutput): `.outputs.embedding`."""

    request_id: str  # caller-visible id
    outputs: EmbeddingOutput  # the embedding
    prompt_token_ids: tuple[int, ...]  # the tokens embedded (after truncate_prompt_tokens)
    finished: bool  # always True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
