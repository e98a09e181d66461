"""Tensor parallelism: the device mesh, the one table of sharding rules, and the layout a model is loaded in."""

from jaxserve.parallel.mesh import TP_AXIS, make_tp_mesh
from jaxserve.parallel.sharding_rules import (KV_POOL_SPEC, PARAM_RULES, TensorParallelLayout, logits_partition_spec,
                                              param_partition_spec, plan_tensor_parallel)

__all__ = ["KV_POOL_SPEC", "PARAM_RULES", "TP_AXIS", "TensorParallelLayout", "logits_partition_spec", "make_tp_mesh",
           "param_partition_spec", "plan_tensor_parallel"]
