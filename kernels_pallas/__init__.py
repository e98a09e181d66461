"""Pallas kernels for GPUs (paged attention, LoRA), independent of the serving code that calls them.

`paged_decode`: ragged paged decode attention (one query token per sequence) over the page pool layout
f[kv_heads, num_pages, page_size, head_dim], lowered through Pallas' Triton backend.
`paged_prefill`: the flattened ragged tokens of a step (prefill chunks and decode tokens mixed), causal within each
sequence after its cached tokens, over the same pool; `plan_prefill` cuts a step's layout into the kernel's work
items once, and `planned_prefill_attention` reuses that plan in every layer.
`lora_bgmv`: each token's own LoRA adapter delta, B[s_t] @ (A[s_t] @ x[t]), reading only the adapters a batch uses.
Each kernel has a plain-jnp reference beside it (`paged_decode_reference`, `paged_prefill_reference`,
`lora_bgmv_reference`), its tests' oracle. Each kernel takes a frozen tuning (DecodeTuning, PrefillTuning);
`default_decode_tuning` and `default_prefill_tuning` pick one from a call's static shapes.
"""

from kernels_pallas.lora_bgmv import BgmvTuning, lora_bgmv, lora_bgmv_reference
from kernels_pallas.paged_decode import (DecodeTuning, default_decode_tuning, paged_decode_attention,
                                         paged_decode_reference)
from kernels_pallas.paged_prefill import (PrefillPlan, PrefillTuning, default_prefill_tuning, paged_prefill_attention,
                                          paged_prefill_reference, plan_prefill, planned_prefill_attention)

__all__ = ["BgmvTuning", "DecodeTuning", "PrefillPlan", "PrefillTuning", "lora_bgmv", "lora_bgmv_reference",
           "default_decode_tuning", "default_prefill_tuning", "paged_decode_attention", "paged_decode_reference",
           "paged_prefill_attention", "paged_prefill_reference", "plan_prefill", "planned_prefill_attention"]
