"""The sharding rules: one table from HF parameter names to partitions, the KV pool's partition, and the layout.

Weights keep HF's `[out, in]` layout. Megatron's split, so each layer needs two all-reduces and nothing else:
  - q/k/v and MLP gate/up are column-parallel (split dim 0, the output features): each device computes whole heads
    and a slice of the MLP's hidden units from the replicated residual stream;
  - o_proj and down_proj are row-parallel (split dim 1, the input features): each device multiplies its heads' (or
    hidden units') slice, and one all-reduce sums the partial outputs back into the replicated residual stream.
Embeddings and lm_head are split on the vocabulary (dim 0), not on hidden: both are the largest single tensors, a
vocab split keeps 1/N of them per device (the tied case shares the one table), the embedding lookup costs one
all-reduce of f[T, hidden], and logits come out split over the vocabulary, to be gathered only for the rows the
sampler reads (f[S, vocab], S sequences, not T tokens). A hidden split would instead all-gather the residual
stream after every lookup and need a reduction inside the logits. Norm weights are tiny and replicated.

The decoder layers' parameters are stacked on a leading layer axis (`model.layers.mlp.up_proj.weight` is
f[num_layers, out, in]); the rules are written for one layer's `[out, in]` and that axis is never split.

A projection's LoRA adapter slots (model/lora.py's LoraStack: A f[layers, slots, r, in], B f[layers, slots, out, r])
split as its weight does (`lora_partition_specs`), so each device's delta is its share of the projection's output:
  - column-parallel (q/k/v, gate/up): B split over out, A replicated; each device computes the whole, small A @ x
    f[T, slots, r] from the replicated input and its own rows of B @ (A @ x), no communication;
  - row-parallel (o_proj, down_proj): A split over in, B replicated; each device's A @ x is a partial sum over its
    input features, which XLA reduces before the replicated B applies, in the same (combined) all-reduce as the base
    matmul's partial sums, so the adapters add bytes (T · slots · r) but no collective.

The KV pool f[kv_heads, num_layers, num_pages, page_size, head_dim] is split over KV heads, so each device owns whole KV heads
and the query heads that read them, and attention needs no communication at all. When a model has fewer KV heads
than devices, each KV head is repeated at load time (rows of k_proj/v_proj), so the model runs with N KV heads.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.errors import ConfigError
from jaxserve.model.config import LlamaConfig
from jaxserve.model.param_names import is_stacked
from jaxserve.parallel.mesh import TP_AXIS, check_positive_size, make_tp_mesh

COLUMN_PARALLEL = P(TP_AXIS, None)  # f[out, in] split over out
ROW_PARALLEL = P(None, TP_AXIS)  # f[out, in] split over in
SPLIT_VECTOR = P(TP_AXIS)  # the bias of a column-parallel projection
REPLICATED = P()

# HF tensor name pattern -> partition; the first match wins, and every parameter must match one.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"\.self_attn\.[qkv]_proj\.weight$", COLUMN_PARALLEL),
    (r"\.self_attn\.[qkv]_proj\.bias$", SPLIT_VECTOR),
    (r"\.self_attn\.o_proj\.weight$", ROW_PARALLEL),
    (r"\.mlp\.(gate|up)_proj\.weight$", COLUMN_PARALLEL),
    (r"\.mlp\.(gate|up)_proj\.bias$", SPLIT_VECTOR),
    (r"\.mlp\.down_proj\.weight$", ROW_PARALLEL),
    # A row-parallel projection's bias is added once, after the all-reduce.
    (r"\.(o_proj|down_proj)\.bias$", REPLICATED),
    (r"^model\.embed_tokens\.weight$", COLUMN_PARALLEL),  # f[vocab, hidden] split over the vocabulary
    (r"^lm_head\.weight$", COLUMN_PARALLEL),  # f[vocab, hidden] split over the vocabulary
    (r"norm\.weight$", REPLICATED),
    (r"\.input_scale$", REPLICATED),  # a static W8A8 checkpoint's activation scale f32[1] per projection
    (r"\.weight_perm$", REPLICATED),  # an act-order 4-bit checkpoint's input permutation i32[in] per projection
)
# f[kv_heads, num_layers, num_pages, page_size, head_dim]: whole KV heads per device.
KV_POOL_SPEC = P(TP_AXIS, None, None, None, None)
# A quantized weight's scales (and zero points) beside it: `...q_proj.weight_scale` for `...q_proj.weight`.
_OF_WEIGHT = (".weight_scale", ".weight_zero_point")
# Rows of k_proj/v_proj (weights, their scales, zero points and biases): one block of head_dim rows per KV head.
_KV_PROJECTION = re.compile(r"\.self_attn\.[kv]_proj\.(weight|weight_scale|weight_zero_point|bias)$")


def logits_partition_spec(vocab_size: int, mesh: Mesh) -> P:
    """f32[rows, vocab] as the vocabulary-split lm_head computes them (whole when the mesh does not divide it)."""
    return P(None, TP_AXIS) if vocab_size % mesh.shape[TP_AXIS] == 0 else P()


def param_partition_spec(name: str, ndim: int = 1) -> P:
    """The rule's partition for parameter `name` (a stacked one with its layer axis whole); raises ValueError for
    a name no rule covers.

    A quantized weight shards like the weight it stands for, and its scale (and zero point) like that weight over
    the axes the scale has: `ndim` (the scale's rank without the layer axis) tells a per-output-channel scale
    f32[out] (1), which splits with the output features (column-parallel) or stays whole (row-parallel: each device
    has every output feature), from a block scale f32[out blocks, in blocks] (2), split on the blocks of the axis
    the weight splits.
    """
    for suffix in _OF_WEIGHT:
        if name.endswith(suffix):
            weight_spec = param_partition_spec(name.removesuffix(suffix) + ".weight")
            return P(*tuple(weight_spec)[:ndim + is_stacked(name)])
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, name):
            return P(None, *spec) if is_stacked(name) else spec
    raise ValueError(f"no sharding rule covers parameter {name}")


def even_partition_spec(name: str, shape: tuple[int, ...], tensor_parallel_size: int) -> P:
    """The rule's partition for tensor `name` of `shape`, with any dimension the mesh does not divide left whole (an
    odd vocabulary, say), since JAX shards evenly only."""
    spec = param_partition_spec(name, len(shape) - is_stacked(name))
    return P(*(axis if axis is None or shape[dim] % tensor_parallel_size == 0 else None
               for dim, axis in enumerate(spec)))


def lora_partition_specs(weight_name: str, weight_shape: tuple[int, ...], tensor_parallel_size: int,
                         slot_axis: bool = True) -> tuple[P, P]:
    """(A's, B's) partition for the LoRA slots of the stacked projection weight `weight_name` f[layers, out, in] of
    `weight_shape`: A f[layers, slots, r, in] split on `in` and B f[layers, slots, out, r] split on `out` exactly as
    the weight is (`even_partition_spec`), the rank and slot axes whole. Without `slot_axis`, for one slot's
    weights: A f[layers, r, in] and B f[layers, out, r]."""
    spec = tuple(even_partition_spec(weight_name, weight_shape, tensor_parallel_size))
    _, out_axis, in_axis = spec + (None,) * (3 - len(spec))
    slots = (None,) if slot_axis else ()
    return P(None, *slots, None, in_axis), P(None, *slots, out_axis, None)


def shard_shape(name: str, shape: tuple[int, ...], tensor_parallel_size: int) -> tuple[int, ...]:
    """The shape of one device's shard of tensor `name` (the whole shape where the rules replicate it)."""
    spec = even_partition_spec(name, shape, tensor_parallel_size)
    return tuple(size if axis is None else size // tensor_parallel_size
                 for size, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How one model is laid out over the devices of a tensor-parallel mesh."""

    mesh: Mesh  # 1-D mesh over TP_AXIS
    checkpoint_config: LlamaConfig  # the model as its checkpoint stores it
    model_config: LlamaConfig  # the model as it runs: num_key_value_heads raised to the mesh size when below it

    @property
    def size(self) -> int:
        """Devices on the tensor-parallel axis."""
        return self.mesh.shape[TP_AXIS]

    @property
    def kv_head_copies(self) -> int:
        """Times each stored KV head is repeated (1 unless the model has fewer KV heads than devices)."""
        return self.model_config.num_key_value_heads // self.checkpoint_config.num_key_value_heads

    def param_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        """The rule's sharding for tensor `name` of `shape` (as the model runs it), as `even_partition_spec` says."""
        return NamedSharding(self.mesh, even_partition_spec(name, shape, self.size))

    def pool_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, KV_POOL_SPEC)

    def stored_rows(self, name: str) -> np.ndarray | None:
        """i64[rows of the model's tensor]: the stored row each row of tensor `name` copies; None where they agree.
        For a stacked parameter the rows are those of each layer's slice (axis 1 of the stacked array).

        Copy c of stored KV head h becomes KV head h * copies + c, so query head q, which read KV head
        q // group with group = heads / kv_heads, now reads head q // (group / copies), one of h's copies: the
        attention each query computes is unchanged.
        """
        if self.kv_head_copies == 1 or not _KV_PROJECTION.search(name):
            return None
        head_dim = self.checkpoint_config.head_dim
        heads = np.repeat(np.arange(self.checkpoint_config.num_key_value_heads), self.kv_head_copies)  # i64[N]
        return (heads[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def plan_tensor_parallel(cfg: LlamaConfig, tensor_parallel_size: int,
                         devices: list[jax.Device] | None = None) -> TensorParallelLayout:
    """The layout of `cfg` over `tensor_parallel_size` devices; ConfigError when the model cannot be split so (checked
    before the device count, so a wrong size is reported the same on any machine)."""
    model_config = running_config(cfg, tensor_parallel_size)
    return TensorParallelLayout(mesh=make_tp_mesh(tensor_parallel_size, devices), checkpoint_config=cfg,
                                model_config=model_config)


def running_config(cfg: LlamaConfig, tensor_parallel_size: int) -> LlamaConfig:
    """`cfg` as it runs over `tensor_parallel_size` devices: KV heads repeated up to the size when fewer. ConfigError
    when the model cannot be split so. Needs no devices, so memory plans for machines not at hand use it too."""
    check_positive_size(tensor_parallel_size)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size {tensor_parallel_size} must divide the model's "
                          f"{heads} attention heads")
    if kv_heads % tensor_parallel_size and tensor_parallel_size % kv_heads:
        raise ConfigError(f"the model's {kv_heads} KV heads cannot be split evenly over {tensor_parallel_size} "
                          f"devices: one must divide the other")
    return dataclasses.replace(cfg, num_key_value_heads=max(kv_heads, tensor_parallel_size))
