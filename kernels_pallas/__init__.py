"""Pallas attention kernels for GPUs, independent of the serving code that calls them.

`paged_decode`: ragged paged decode attention (one query token per sequence) over the page pool layout
f[kv_heads, num_pages, page_size, head_dim], lowered through Pallas' Triton backend.
"""

from kernels_pallas.paged_decode import DecodeTuning, paged_decode_attention, paged_decode_reference

__all__ = ["DecodeTuning", "paged_decode_attention", "paged_decode_reference"]
