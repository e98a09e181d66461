"""Pallas attention kernels for GPUs, independent of the serving code that calls them.

`paged_decode`: ragged paged decode attention (one query token per sequence) over the page pool layout
f[kv_heads, num_pages, page_size, head_dim], lowered through Pallas' Triton backend.
`paged_prefill`: the flattened ragged tokens of a step (prefill chunks and decode tokens mixed), causal within each
sequence after its cached tokens, over the same pool.
"""

from kernels_pallas.paged_decode import DecodeTuning, paged_decode_attention, paged_decode_reference
from kernels_pallas.paged_prefill import PrefillTuning, paged_prefill_attention

__all__ = ["DecodeTuning", "PrefillTuning", "paged_decode_attention", "paged_decode_reference",
           "paged_prefill_attention"]
