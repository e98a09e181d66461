"""What an engine program should cost, from the model's shapes and its bucket alone: the bytes it cannot avoid
moving per run, and the activations it holds, on one device. The audit measures the compiled program against them.

Must-read: every weight shard once (of the embedding table only the rows the step's tokens look up, when lm_head is
a separate weight), the KV pages each sequence attends to (an assumed context per sequence) and the KV the step's
tokens write, the step's inputs, and the logits rows it writes. A sampler must read its logits and inputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.gpu_programs.arguments import ProgramArgument, ProgramFacts, Role
from jaxserve.model.config import LlamaConfig
from jaxserve.runner.buckets import StepBucket
from jaxserve.runner.step import PROMPT_SCORE_TILE

LOGITS_BYTES = 4  # logits are float32
_EMBEDDING = "model.embed_tokens.weight"


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """One program's sizes on one device."""

    tokens: int  # T
    rows: int  # S: sequence rows, or a sampler's rows
    logits_rows: int  # rows of logits the step computes (S; S * (K + 1) when verifying drafts)
    scoring_tile: int  # rows of prompt-score logits alive at once; 0 without prompt scoring
    sampler: bool  # a sampler program (logits in, tokens out)
    hidden: int  # the residual stream's width
    layer_width: int  # one token's widest intermediates in one layer: q, k, v heads plus gate and up, this shard
    vocab: int
    activation_itemsize: int  # bytes per activation element
    # KV bytes one token holds in one layer on this device (K and V of this device's KV heads)
    kv_token_layer_bytes: int
    layers: int
    context_tokens: int  # each sequence's assumed context

    @classmethod
    def of(cls, model: LlamaConfig, config: EngineConfig, bucket: StepBucket, dtype, context_tokens: int,
           kv_dtype) -> StepShapes:
        tp = config.tensor_parallel_size
        heads, kv_heads = model.num_attention_heads // tp, model.num_key_value_heads // tp
        drafts = config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0
        logits_rows = bucket.num_seqs * (drafts + 1) if bucket.drafts else bucket.num_seqs
        return cls(tokens=bucket.num_tokens, rows=bucket.num_seqs, logits_rows=logits_rows,
                   scoring_tile=min(bucket.num_tokens, PROMPT_SCORE_TILE) if bucket.prompt_logits else 0,
                   sampler=False, hidden=model.hidden_size,
                   layer_width=(heads + 2 * kv_heads) * model.head_dim + 2 * model.intermediate_size // tp,
                   vocab=model.vocab_size, activation_itemsize=np.dtype(dtype).itemsize,
                   kv_token_layer_bytes=2 * kv_heads * model.head_dim * np.dtype(kv_dtype).itemsize,
                   layers=model.num_hidden_layers, context_tokens=context_tokens)

    def for_sampler(self) -> StepShapes:
        return dataclasses.replace(self, sampler=True, logits_rows=self.rows, scoring_tile=0)

    @property
    def logits_bytes(self) -> int:
        return self.logits_rows * self.vocab * LOGITS_BYTES

    @property
    def activation_bytes(self) -> int:
        """One layer's intermediates for every token (the residual stream beside them), the logits, and a prompt
        score tile's logits and log-probabilities."""
        if self.sampler:
            return self.logits_bytes
        layer = self.tokens * (self.hidden + self.layer_width) * self.activation_itemsize
        return layer + self.logits_bytes + 2 * self.scoring_tile * self.vocab * LOGITS_BYTES

    @property
    def kv_read_per_call_bytes(self) -> int:
        """K (or V) of one layer that the step's sequences attend to."""
        return self.rows * self.context_tokens * self.kv_token_layer_bytes // 2

    @property
    def kv_bytes(self) -> int:
        """KV read (each row's context) and written (the step's tokens), every layer."""
        return (self.rows * self.context_tokens + self.tokens) * self.kv_token_layer_bytes * self.layers


def program_facts(name: str, kind: str, arguments: tuple[ProgramArgument, ...], shapes: StepShapes) -> ProgramFacts:
    if kind == "sampler":
        shapes = shapes.for_sampler()
        must = sum(a.bytes for a in arguments)
    else:
        must = (_weight_bytes(arguments, shapes) + shapes.kv_bytes + shapes.logits_bytes
                + sum(a.bytes for a in arguments if a.role in (Role.INPUT, Role.ADAPTER)))
    return ProgramFacts(name, kind, arguments, must_read_bytes=must, activation_bytes=shapes.activation_bytes,
                        kv_read_per_call_bytes=0 if kind == "sampler" else shapes.kv_read_per_call_bytes)


def _weight_bytes(arguments: tuple[ProgramArgument, ...], shapes: StepShapes) -> int:
    """Every weight shard once; of a separate embedding table only the looked-up rows."""
    weights = [a for a in arguments if a.role is Role.WEIGHT]
    tied = not any(a.name == "lm_head.weight" for a in weights)
    total = 0
    for argument in weights:
        if argument.name == _EMBEDDING and not tied:
            row = argument.bytes // argument.shard_dims[0]
            total += min(argument.bytes, shapes.tokens * row)
        else:
            total += argument.bytes
    return total
