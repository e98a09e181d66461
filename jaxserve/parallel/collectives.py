"""The collectives a compiled step program runs, read from its HLO text, and the number the sharding rules predict.

Used by the tensor-parallel tests and benchmarks/tensor_parallel.py to check that XLA's SPMD partitioner placed
exactly the communication the rules imply, and nothing more (a stray all-gather of a weight would cost far more
than the step's compute at large sizes).
"""

from __future__ import annotations

import collections
import re

from jaxserve.model.config import LlamaConfig

# "%x = f32[2,512]{1,0} all-gather(...)" or its async "-start" form; group 1 is the result type, group 2 the op.
# One result type, or a tuple of them where XLA combined several collectives into one ("= (f32[..], f32[..])
# all-reduce(").
_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective op -> how many the compiled (partitioned) program runs."""
    return dict(collections.Counter(match.group(2) for match in _COLLECTIVE.finditer(hlo)))


def all_gather_shapes(hlo: str) -> list[str]:
    """Result types of the program's all-gathers, e.g. "f32[1,512]{0,1}"."""
    return [match.group(1) for match in _COLLECTIVE.finditer(hlo) if match.group(2) == "all-gather"]


def predicted_step_collectives(cfg: LlamaConfig, tensor_parallel_size: int) -> dict[str, int]:
    """What one step program's text should hold over `tensor_parallel_size` devices: two all-reduces in the layer
    body (after the row-parallel o_proj and down_proj; the body is written once and runs once per layer, so the
    text holds two whatever the depth), and, when the mesh divides the vocabulary (so embedding and lm_head are
    split over it), one all-reduce for the embedding lookup and one all-gather of the sampled rows' logits."""
    if tensor_parallel_size == 1:
        return {}
    vocab_split = cfg.vocab_size % tensor_parallel_size == 0
    predicted = {"all-reduce": 2 + int(vocab_split)}
    if vocab_split:
        predicted["all-gather"] = 1
    return predicted
