"""How many KV pages the pool gets: explicit, from a memory budget, or from the device's free memory.

Under tensor parallelism everything is counted per device: a page's bytes on one device (its share of the KV heads),
the device's own weight shards (what its allocator reports in use) and the per-device workspace of the largest step.
"""

from __future__ import annotations

import jax

from jaxserve.errors import ConfigError
from jaxserve.model.config import LlamaConfig


def bytes_per_page(model: LlamaConfig, page_size: int, dtype, tensor_parallel_size: int = 1) -> int:
    """K and V of one page across all layers, on one device: the pool is split over KV heads, `model`'s KV heads
    (already repeated up to the tensor-parallel size when fewer) divided evenly over the devices."""
    itemsize = jax.numpy.dtype(dtype).itemsize
    kv_heads_per_device = model.num_key_value_heads // tensor_parallel_size
    return 2 * model.num_hidden_layers * kv_heads_per_device * model.head_dim * page_size * itemsize


def device_memory_stats() -> dict | None:
    """This process's first device's allocator statistics; None where the backend keeps none (the CPU).

    Local, not global: another process's devices keep no statistics here.
    """
    stats = jax.local_devices()[0].memory_stats()
    return stats if stats and "bytes_limit" in stats else None


# XLA:GPU schedules a program within 80% of the device's memory, less the program's arguments and outputs; where
# those alone exceed it (weights and a pool sized to 92% of the device), it "rematerializes": it recomputes values,
# projections among them, reading their weights twice per step (the GPU program audit counts the recomputed
# operations). A memory-sized pool stays within that share, less a margin for the step's other inputs and outputs.
XLA_SCHEDULER_MEMORY_SHARE = 0.80
STEP_IO_MARGIN_SHARE = 0.01


def device_budget_bytes(memory_stats: dict, gpu_memory_utilization: float, mem_fraction: float) -> float:
    """What weights, workspace and pool may take: the utilization's share of the device's whole memory, capped by
    the allocator's limit (its share `mem_fraction` of the device) and by what XLA:GPU's scheduler counts on."""
    device_bytes = memory_stats["bytes_limit"] / mem_fraction
    scheduler_bytes = device_bytes * (XLA_SCHEDULER_MEMORY_SHARE - STEP_IO_MARGIN_SHARE)
    return min(device_bytes * gpu_memory_utilization, memory_stats["bytes_limit"], scheduler_bytes)


def resolve_num_pages(model: LlamaConfig, dtype, *, page_size: int, max_num_seqs: int, max_model_len: int,
                      num_kv_pages: int | None, kv_cache_memory_gb: float | None, gpu_memory_utilization: float,
                      memory_stats: dict | None, workspace_bytes: int = 0, tensor_parallel_size: int = 1,
                      allocator_share: float = 1.0, extra_bytes_per_page: int = 0) -> int:
    """Pages in the pool, the null page included.

    Explicit `num_kv_pages` wins; then `kv_cache_memory_gb` (per device); then, on a device that reports memory,
    the share `gpu_memory_utilization` of its memory minus what is already in use (its weight shards) and minus the
    activation workspace of the largest compiled step; elsewhere (the CPU) enough pages for max_num_seqs full
    sequences. Every device holds the same share of every page, so one device's budget sizes the whole pool.
    A memory-sized pool that cannot hold one max_model_len sequence, or weights and workspace that leave it no
    room, is a ConfigError naming the limit to lower (raised before any step program compiles).
    `allocator_share` is the share of the device's memory that `bytes_limit` stands for (device_memory.py).
    `extra_bytes_per_page`: what each page costs besides the model's KV (a draft model's pool mirrors the pages).
    """
    per_page = bytes_per_page(model, page_size, dtype, tensor_parallel_size) + extra_bytes_per_page
    if num_kv_pages is not None:
        return _at_least_one_page(num_kv_pages, per_page)
    if kv_cache_memory_gb is not None:
        pages = int(kv_cache_memory_gb * 2**30 // per_page) + 1
    elif memory_stats is not None:
        budget = device_budget_bytes(memory_stats, gpu_memory_utilization, allocator_share)
        _check_weights_and_workspace_fit(budget, memory_stats.get("bytes_in_use", 0), workspace_bytes)
        pages = int((budget - memory_stats.get("bytes_in_use", 0) - workspace_bytes) // per_page) + 1
    else:
        return max_num_seqs * -(-max_model_len // page_size) + 1
    _check_one_sequence_fits(_at_least_one_page(pages, per_page), per_page, page_size, max_model_len)
    return pages


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _check_weights_and_workspace_fit(budget: float, weights: int, workspace: int) -> None:
    """Before compiling: weights and the largest step's activations must leave the pool some room."""
    if weights + workspace >= budget:
        raise ConfigError(f"the weights ({_gib(weights)} per device) and the largest step's workspace "
                          f"({_gib(workspace)}) fill the memory budget ({_gib(budget)}, gpu_memory_utilization of "
                          "the device), leaving none for the KV cache: lower max_num_batched_tokens "
                          "(--max-num-batched-tokens) or max_num_seqs (--max-num-seqs), which size the workspace, "
                          "raise gpu_memory_utilization, or split the model over more devices (--tensor-parallel-size)")


# How much a compiled program's workspace may exceed the sizing's measurement (buffer alignment, a program compiled
# at the real pool size) before the plan is wrong.
WORKSPACE_SLACK_BYTES = 64 * 2**20
WORKSPACE_SLACK_SHARE = 0.1


def check_workspace_plan(planned_bytes: int, workspaces: dict[str, int]) -> None:
    """After compiling at the pool's real size: a program needing much more workspace than the pool's sizing set
    aside (measured on a two-page pool) would run out of memory mid-run, failing its requests; it is a start-up error
    instead, naming the program. A workspace that grows with the pool means XLA copies (part of) the pool."""
    if not workspaces:
        return
    name, largest = largest_workspace(workspaces)
    if largest > planned_bytes * (1 + WORKSPACE_SLACK_SHARE) + WORKSPACE_SLACK_BYTES:
        raise ConfigError(f"the {name} program needs {_gib(largest)} of workspace at this pool size, more than the "
                          f"{_gib(planned_bytes)} the KV cache's sizing left for it (a copy of the pool inside it): "
                          "set the cache's size instead (--kv-cache-memory-gb, or a lower --gpu-memory-utilization) "
                          "and report the program")


def largest_workspace(workspaces: dict[str, int]) -> tuple[str, int]:
    """The program needing the most temporary memory, and how much."""
    return max(workspaces.items(), key=lambda item: item[1])


def workspace_summary(workspaces: dict[str, int]) -> str:
    """One line for operators: the largest program's workspace, what the device must hold beside weights and pool."""
    if not workspaces:
        return "no step programs compiled"
    name, largest = largest_workspace(workspaces)
    return f"largest workspace of {len(workspaces)} programs: {largest / 2**20:.1f} MiB ({name})"


def _check_one_sequence_fits(pages: int, per_page: int, page_size: int, max_model_len: int) -> None:
    """A pool sized from memory must hold one sequence of max_model_len tokens, or that length could never run."""
    needed = -(-max_model_len // page_size)
    if pages - 1 < needed:
        raise ConfigError(f"the KV cache fits {pages - 1} pages ({_gib((pages - 1) * per_page)}, "
                          f"{(pages - 1) * page_size} tokens per device), fewer than one sequence of max_model_len "
                          f"({max_model_len} tokens, {_gib(needed * per_page)}): lower max_model_len "
                          "(--max-model-len) or give the cache more memory (--gpu-memory-utilization, "
                          "--kv-cache-memory-gb)")


def _at_least_one_page(pages: int, per_page: int) -> int:
    if pages < 2:
        raise ConfigError(f"the KV cache gets {pages} pages of {per_page} bytes: not enough for one page; "
                          "lower max_model_len or max_num_batched_tokens, or give the cache more memory")
    return pages
