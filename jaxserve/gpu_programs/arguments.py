"""What a compiled program is given and what it is for: the facts the audit measures its HLO against.

The program's entry parameters are its arguments as one device holds them (shards, under tensor parallelism), in
the order JAX flattened them. Each is named and given a role, so that a copy found in the HLO can say whose bytes it
copies: a weight, the KV pool, an adapter, or a step input.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

# numpy's dtype names -> XLA's element types, as the HLO text spells them.
_XLA_ELEMENT_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int8": "s8",
                      "int16": "s16", "int32": "s32", "int64": "s64", "uint8": "u8", "uint16": "u16",
                      "uint32": "u32", "uint64": "u64", "bool": "pred", "float8_e4m3fn": "f8e4m3fn",
                      "float8_e5m2": "f8e5m2", "int4": "s4", "uint4": "u4"}


class Role(enum.Enum):
    """What an argument holds, for the audit's findings."""

    WEIGHT = "weight"  # a model parameter, read every step
    POOL = "pool"  # the KV cache (donated)
    ADAPTER = "adapter"  # LoRA adapter slots
    INPUT = "input"  # the step's own inputs (token ids, tables, sampling settings, logits)


@dataclasses.dataclass(frozen=True)
class ProgramArgument:
    """One flattened argument of a program, as one device holds it."""

    name: str  # e.g. "model.layers.mlp.up_proj.weight", "pool.k_pages", "packed"
    role: Role
    dtype: str  # XLA element type of its shard, e.g. "bf16"
    shard_dims: tuple[int, ...]  # its shard's shape on one device
    # The axis that runs over decoder layers (0 for a stacked weight or adapter, 1 for the pool
    # f[kv_heads, layers, pages, page_size, head_dim]); None: it has none
    layer_axis: int | None = None

    @property
    def bytes(self) -> int:
        return math.prod(self.shard_dims) * np.dtype(_numpy_dtype(self.dtype)).itemsize

    @property
    def is_layer_matrix(self) -> bool:
        """Each layer of it is a matrix or more (a projection's weight, adapter, the pool's pages), not a vector (a
        norm's weight, a scale): what a copy worth reporting is made of."""
        dims = [d for axis, d in enumerate(self.shard_dims) if axis != self.layer_axis]
        return sum(1 for d in dims if d > 1) >= 2

    @property
    def layer_elements(self) -> int:
        """Elements of one layer of it (all of it when it has no layer axis): a materialized array this large, made
        from it, is a copy of at least a layer."""
        elements = math.prod(self.shard_dims)
        return elements // self.shard_dims[self.layer_axis] if self.layer_axis is not None else elements


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
    """A program and what it is expected to do per run, on one device: what the audit measures it against."""

    name: str  # e.g. "decode S=1", "mixed T=512 S=64", "sampler S=64"
    kind: str  # "decode", "mixed", "scoring", "verify" or "sampler"
    arguments: tuple[ProgramArgument, ...]  # its entry parameters, in order
    # Bytes the program cannot avoid reading or writing per run: weights once, the KV its tokens attend to and
    # write, the logits a sampler reads
    must_read_bytes: int
    # Bytes of the largest activations it holds at once (one layer's intermediates plus the logits): its temp memory
    # is measured against this
    activation_bytes: int
    # Bytes of one pool array (K or V) that one attention kernel call reads: the KV touched in one layer. A kernel's
    # page reads are data dependent, so they are counted at this assumed size
    kv_read_per_call_bytes: int = 0


def xla_element_type(dtype) -> str:
    """XLA's name of a numpy (or JAX) dtype."""
    name = np.dtype(dtype).name
    return _XLA_ELEMENT_TYPES.get(name, name)


def _numpy_dtype(element_type: str):
    import ml_dtypes  # JAX's own dependency: bfloat16 and the float8 types

    names = {xla: np_name for np_name, xla in _XLA_ELEMENT_TYPES.items()}
    name = names.get(element_type, element_type)
    return getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else np.dtype(name)
