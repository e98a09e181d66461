"""Every Pallas kernel compiled for this device (Triton on a GPU; Pallas' interpreter on the CPU) and checked against
the float32 XLA paged attention on random ragged batches: decode (the decode kernel), prefill and mixed (the mixed
kernel the engine runs), over GQA groups, head dims and page sizes. Inputs, tunings and the reference are
benchmarks/kernels.py's, so what passes here is what that benchmark times.

A ragged batch holds the lengths where masks and page boundaries go wrong: 1, page - 1, page, page + 1, a few pages
and a long one; block tables are random permutations of the pool's pages. A case passes when the kernel's output is
finite and its relative L2 error is within kernels.CORRECT_REL_ERROR (the XLA path's own bf16 error is recorded
beside it for scale).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import jax
import numpy as np

from gpu_parts.context import PartContext, PartOutcome, markdown_table
from kernels import (CORRECT_REL_ERROR, AttentionShape, Batch, Variant, build_inputs, checked_reference, describe,
                     engine_prefill_tuning, output_errors, pallas_decode_variant, pallas_step_variant,
                     shape_decode_tuning, xla_variant)

DTYPE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call to check."""

    kind: str  # "decode", "prefill" or "mixed"
    group: int  # query heads per KV head
    head_dim: int  # size of one head's query, key and value vectors
    page_size: int  # tokens per KV page
    kv_heads: int  # KV heads of the pool (query heads: group * kv_heads)

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape(self.group * self.kv_heads, self.kv_heads, self.head_dim, self.page_size, DTYPE)

    @property
    def label(self) -> str:
        return f"{self.kind} gqa{self.group} d{self.head_dim} p{self.page_size}"


def ragged_batch(kind: str, page: int, long_len: int) -> Batch:
    """Sequences as (tokens cached before this call, tokens this call brings): decode brings one each, prefill
    chunks of several (some after cached context), mixed both in one call."""
    lengths = (1, page - 1, page, page + 1, 3 * page + 5, long_len)
    if kind == "decode":
        sequences = [(length - 1, 1) for length in lengths]
    elif kind == "prefill":
        sequences = [(0, page + 3), (page - 1, 2), (page, page), (3 * page + 1, 2 * page - 1), (long_len, 5)]
    else:
        sequences = [(0, page + 3), (page, 1), (page - 1, 2), (long_len, 1), (2 * page, page), (2, 1)]
    return Batch(seq_lens=tuple(cached + new for cached, new in sequences),
                 query_lens=tuple(new for _, new in sequences))


def kernel_variant(case: Case, batch: Batch, interpret: bool) -> Variant:
    """The kernel the engine would run on this call, with the tuning it would pick."""
    shape = case.shape
    if case.kind == "decode":
        return pallas_decode_variant(shape_decode_tuning(batch, shape), shape.scale, interpret)
    return pallas_step_variant("pallas", engine_prefill_tuning(batch, shape), shape.scale, interpret)


def check_case(case: Case, long_len: int, interpret: bool, seed: int) -> dict[str, Any]:
    """The kernel's and the bf16 XLA path's errors against the float32 reference, or the kernel's failure."""
    batch = ragged_batch(case.kind, case.page_size, long_len)
    record: dict[str, Any] = {**dataclasses.asdict(case), "seq_lens": batch.seq_lens, "query_lens": batch.query_lens}
    inputs = build_inputs(batch, case.shape, rotate_bytes=0, seed=seed)[0]
    reference, rows = checked_reference(inputs, batch, case.shape.scale, max_seqs=batch.num_seqs)
    for name, variant in (("kernel", kernel_variant(case, batch, interpret)), ("xla", xla_variant(case.shape.scale))):
        start = time.perf_counter()
        try:
            output = jax.block_until_ready(variant.run(*variant.arguments(inputs)))  # f[T, heads, head_dim]
            record[f"{name}_max_abs_error"], record[f"{name}_rel_error"] = output_errors(output[:rows], reference)
            record[f"{name}_tuning"] = variant.tuning
        except Exception as error:  # a kernel that does not compile or run is this check's finding
            record[f"{name}_error"] = describe(error)
        record[f"{name}_first_call_s"] = time.perf_counter() - start
    rel = record.get("kernel_rel_error")
    record["passed"] = rel is not None and bool(np.isfinite(rel)) and rel <= CORRECT_REL_ERROR
    return record


def run(context: PartContext, kinds: list[str], groups: list[int], head_dims: list[int], page_sizes: list[int],
        kv_heads: int, long_len: int, seed: int = 0) -> PartOutcome:
    interpret = jax.default_backend() != "gpu"  # Triton needs a GPU; elsewhere the interpreter runs the same kernel
    cases = [Case(kind, group, head_dim, page, kv_heads)
             for kind, group, head_dim, page in itertools.product(kinds, groups, head_dims, page_sizes)]
    records = []
    for case in cases:
        records.append(check_case(case, long_len, interpret, seed))
        print(f"{case.label}: {'pass' if records[-1]['passed'] else 'FAIL'} "
              f"(rel error {records[-1].get('kernel_rel_error')})", flush=True)
    figures = {"interpret": interpret, "tolerance_rel_error": CORRECT_REL_ERROR, "cases": records}
    return PartOutcome(figures, summary(figures), passed=all(r["passed"] for r in records))


def error_text(record: dict[str, Any], name: str) -> str:
    if f"{name}_error" in record:
        return "failed: " + record[f"{name}_error"].splitlines()[0][:120]
    return f"{record[f'{name}_max_abs_error']:.1e} / {record[f'{name}_rel_error']:.1e}"


def summary(figures: dict[str, Any]) -> str:
    cases = figures["cases"]
    mode = "kernels interpreted: no GPU" if figures["interpret"] else "kernels compiled by Triton"
    header = (f"{sum(r['passed'] for r in cases)}/{len(cases)} cases pass ({mode}; relative L2 error <= "
              f"{figures['tolerance_rel_error']:g} against the float32 reference).\n\n")
    rows = [[f"{r['kind']} gqa{r['group']} d{r['head_dim']} p{r['page_size']}", "pass" if r["passed"] else "**FAIL**",
             error_text(r, "kernel"), error_text(r, "xla"), f"{r['kernel_first_call_s']:.1f}"] for r in cases]
    return header + markdown_table(["case", "verdict", "kernel max abs / rel", "xla bf16 max abs / rel",
                                    "compile + run s"], rows)
