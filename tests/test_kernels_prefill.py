"""The Pallas paged prefill (mixed batch) kernel: interpret-mode equality with the serving reference on ragged
steps, its work list, and its CUDA lowering on any host.

Pools are tiny on purpose: interpret mode copies each KV head's whole pool at every grid step.
"""

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, paged_attention_xla
from jaxserve.runner.paged_inputs import build_metadata
from jaxserve.schedule import NULL_PAGE
from kernels_pallas import paged_decode_reference, paged_prefill_reference
from kernels_pallas.common import MAX_DEFAULT_KEY_SLOTS, MAX_DEFAULT_TILE_BYTES, MIN_DOT_DIM, check_pool
from kernels_pallas.paged_prefill import (MAX_DEFAULT_ROWS, PrefillTuning, build_work_list, default_prefill_tuning,
                                          paged_prefill_attention, plan_prefill, planned_prefill_attention)
from tests.cuda_lowering import export_for_h100, triton_calls


class Chunk(NamedTuple):
    """A scheduled chunk as build_metadata reads it."""

    start_position: int  # tokens already cached
    num_tokens: int  # tokens computed this step
    page_ids: list[int]  # the sequence's pages


PAGE_SIZE = 8
MAX_PAGES = 4  # longest sequence: 32 tokens
KV_HEADS = 2
FREE_PAGES = 4  # pages no sequence owns, poisoned with NaN
TUNING = PrefillTuning(block_q=4, pages_per_block=2)  # 16-slot key tiles: the smallest Triton's dot takes
TOLERANCES = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# (sequence length after the step, query tokens this step): a row with nothing scheduled, decode tokens at lengths
# 1, page-1 and full, whole prompts of page and page+1 tokens, and prefill chunks after cached context (one
# crossing a page boundary, one ending at the block table's end).
RAGGED_SEQUENCES = ((0, 0), (1, 1), (PAGE_SIZE - 1, 1), (PAGE_SIZE, PAGE_SIZE), (PAGE_SIZE + 1, PAGE_SIZE + 1),
                    (PAGE_SIZE + 1, 3), (17, 6), (MAX_PAGES * PAGE_SIZE, 1), (MAX_PAGES * PAGE_SIZE, 5))
NUM_TOKENS = 40  # T bucket: 35 real tokens and 5 padding tokens


def _pages_for(length: int) -> int:
    return -(-length // PAGE_SIZE)


class Step(NamedTuple):
    """One random step: queries, the pool after the step's writes, the metadata and the positions."""

    q: jax.Array  # f[T, heads, head_dim]
    k_pages: jax.Array  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array  # f[kv_heads, num_pages, page_size, head_dim]
    metadata: PagedAttentionMetadata
    positions: jax.Array  # i32[T]

    def kernel_inputs(self):
        m = self.metadata
        return (self.q, self.k_pages, self.v_pages, m.block_tables, m.seq_lens, m.token_seq, self.positions)


def ragged_step(seed: int, dtype, group: int, head_dim: int, *, spare_row: bool = True,
                unused_entries: str = "random") -> Step:
    """A step over RAGGED_SEQUENCES on a NaN-poisoned pool with shuffled pages.

    Every sequence's tokens (earlier chunks' and this step's) are in the pool; free pages and the unused slots of
    each last page hold NaN, page 0 is zero. Block-table entries past a sequence's pages are random pages
    ("random", which the kernel must not trust) or the null page. Without a spare row, padding tokens share the
    last real row at position 0, as build_metadata lays them out.
    """
    rng = np.random.default_rng(seed)
    num_pages = 1 + sum(_pages_for(length) for length, _ in RAGGED_SEQUENCES) + FREE_PAGES
    shuffled = iter(rng.permutation(np.arange(1, num_pages)))
    shape = (KV_HEADS, num_pages, PAGE_SIZE, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)  # f32[kv_heads, num_pages, page_size, head_dim]
    v_pages = np.full(shape, np.nan, np.float32)
    k_pages[:, NULL_PAGE] = v_pages[:, NULL_PAGE] = 0.0
    chunks = []
    for length, count in RAGGED_SEQUENCES:
        pages = [int(next(shuffled)) for _ in range(_pages_for(length))]
        for position in range(length):
            page, offset = pages[position // PAGE_SIZE], position % PAGE_SIZE
            k_pages[:, page, offset] = rng.standard_normal((KV_HEADS, head_dim))
            v_pages[:, page, offset] = rng.standard_normal((KV_HEADS, head_dim))
        chunks.append(Chunk(length - count, count, pages))
    num_seqs = len(chunks) + 1 if spare_row else len(chunks)
    inputs = build_metadata(chunks, num_tokens=NUM_TOKENS, num_seqs=num_seqs, max_pages=MAX_PAGES,
                            page_size=PAGE_SIZE)
    block_tables = inputs.metadata.block_tables.copy()  # i32[S, MAX_PAGES]
    if unused_entries == "random":
        for row, (length, _) in enumerate(RAGGED_SEQUENCES):
            unused = MAX_PAGES - _pages_for(length)
            block_tables[row, MAX_PAGES - unused:] = rng.integers(0, num_pages, unused)
    metadata = PagedAttentionMetadata(slot_mapping=jnp.asarray(inputs.metadata.slot_mapping),
                                      token_seq=jnp.asarray(inputs.metadata.token_seq),
                                      block_tables=jnp.asarray(block_tables),
                                      seq_lens=jnp.asarray(inputs.metadata.seq_lens))
    q = rng.standard_normal((NUM_TOKENS, KV_HEADS * group, head_dim))  # f64[T, heads, head_dim]
    return Step(jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), metadata,
                jnp.asarray(inputs.positions))


def real_tokens() -> int:
    return sum(count for _, count in RAGGED_SEQUENCES)


def reference(step: Step, scale: float) -> jax.Array:
    metadata = step.metadata
    return paged_prefill_reference(step.q, step.k_pages, step.v_pages, metadata.block_tables, metadata.seq_lens,
                                   metadata.token_seq, step.positions, sm_scale=scale)


def assert_matches(actual: jax.Array, expected: jax.Array, dtype):
    assert actual.dtype == expected.dtype == dtype
    assert not jnp.isnan(actual).any(), "masked NaN reached the output"
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (4, 64), (8, 64), (4, 128)])
def test_kernel_matches_reference_on_ragged_step(dtype, group, head_dim):
    step = ragged_step(group * head_dim, dtype, group, head_dim)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=scale, tuning=TUNING, interpret=True)
    assert_matches(out, reference(step, scale), dtype)
    np.testing.assert_array_equal(np.asarray(out[real_tokens():], np.float32), 0.0)  # padding tokens: zeros


@pytest.mark.parametrize("tuning", [PrefillTuning(block_q=1, pages_per_block=2),
                                    PrefillTuning(block_q=3, pages_per_block=2),
                                    PrefillTuning(block_q=16, pages_per_block=4)], ids=["q1", "q3", "q16-4pages"])
def test_tunings_agree(tuning):
    """Query blocks of one token, of a size that does not divide the chunks, and wide page blocks change only the
    schedule, not the result."""
    step = ragged_step(7, jnp.float32, 2, 64, unused_entries="null")
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=0.125, tuning=tuning, interpret=True)
    assert_matches(out, reference(step, 0.125), jnp.float32)


def test_padding_tokens_sharing_the_last_row_match_the_reference():
    """With no spare row, padding tokens read the last real row at position 0: finite, as the reference says."""
    step = ragged_step(11, jnp.float32, 4, 64, spare_row=False)
    assert (np.asarray(step.metadata.token_seq[real_tokens():]) == len(RAGGED_SEQUENCES) - 1).all()
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=0.125, tuning=TUNING, interpret=True)
    assert_matches(out, reference(step, 0.125), jnp.float32)


def test_logits_soft_cap_on_decode_tokens():
    """The serving reference has no soft cap; on decode-only metadata the decode reference (which has) is the
    oracle."""
    step = ragged_step(3, jnp.float32, 2, 64, unused_entries="null")
    lengths = step.metadata.seq_lens
    seqs = lengths.shape[0]
    q = step.q[:seqs]  # f32[S, heads, head_dim]: one decode token per sequence, at its last position
    args = (q, step.k_pages, step.v_pages, step.metadata.block_tables, lengths, jnp.arange(seqs, dtype=jnp.int32),
            jnp.maximum(lengths - 1, 0))
    # A large scale makes raw scores reach tens, where the cap changes the result.
    out = paged_prefill_attention(*args, sm_scale=2.0, logits_soft_cap=5.0, tuning=TUNING, interpret=True)
    expected = paged_decode_reference(q, step.k_pages, step.v_pages, step.metadata.block_tables, lengths,
                                      sm_scale=2.0, logits_soft_cap=5.0)
    assert_matches(out, expected, jnp.float32)
    assert not np.allclose(expected, paged_decode_reference(q, step.k_pages, step.v_pages,
                                                            step.metadata.block_tables, lengths, sm_scale=2.0),
                           atol=1e-3)


def test_one_plan_serves_every_layer_through_its_page_offset():
    """A plan cut from the step's own block tables, used on a pool of two layers (layer 1's pages after layer 0's)
    with each layer's page offset, gives each layer's own attention."""
    first = ragged_step(21, jnp.float32, 4, 64)
    # Layer 1 holds other K/V in the same slots (zeros and NaN where layer 0 has them), and other queries.
    layers = [first, first._replace(q=first.q[::-1], k_pages=-1.5 * first.k_pages, v_pages=2.0 * first.v_pages)]
    num_pages = first.k_pages.shape[1]
    k_pool = jnp.concatenate([step.k_pages for step in layers], axis=1)  # f32[kv_heads, 2 * num_pages, ...]
    v_pool = jnp.concatenate([step.v_pages for step in layers], axis=1)
    m = first.metadata
    plan = plan_prefill(m.block_tables, m.seq_lens, m.token_seq, first.positions, group=4, tuning=TUNING)
    for layer, step in enumerate(layers):
        out = planned_prefill_attention(step.q, k_pool, v_pool, plan, page_offset=layer * num_pages, sm_scale=0.125,
                                        interpret=True)
        assert_matches(out, reference(step, 0.125), jnp.float32)


def test_a_plan_refuses_a_call_of_another_shape():
    step = ragged_step(23, jnp.float32, 4, 64)
    m = step.metadata
    plan = plan_prefill(m.block_tables, m.seq_lens, m.token_seq, step.positions, group=2, tuning=TUNING)
    with pytest.raises(ValueError, match="plan was made for 2 query heads per KV head, the call has 4"):
        planned_prefill_attention(step.q, step.k_pages, step.v_pages, plan, sm_scale=0.125, interpret=True)


def test_work_list_cuts_runs_into_query_blocks():
    token_seq = jnp.asarray([0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3], jnp.int32)
    work = build_work_list(token_seq, num_seqs=4, block_q=2)
    np.testing.assert_array_equal(work.first_token, [0, 2, 4, 5, 6, 8, 9, 0, 0])
    np.testing.assert_array_equal(work.num_tokens, [2, 2, 1, 1, 2, 1, 2, 0, 0])
    np.testing.assert_array_equal(work.seq_row[:7], [0, 0, 0, 1, 2, 2, 3])
    np.testing.assert_array_equal(work.token_item, [0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 6])
    np.testing.assert_array_equal(work.token_offset, [0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 1])


@pytest.mark.parametrize("field, value, message", [
    ("block_q", 0, "positive int"),
    ("block_q", False, "positive int"),
    ("pages_per_block", 3, "power of two"),
    ("pages_per_block", -2, "positive int"),
    ("num_warps", 6, "power of two"),
    ("num_stages", 1.5, "positive int"),
])
def test_tuning_rejects_invalid_values(field, value, message):
    with pytest.raises(ValueError, match=f"PrefillTuning.{field}.*{message}"):
        PrefillTuning(**{field: value})


def test_default_tuning_is_valid_over_serving_shapes():
    """Every shape gets a tuning the kernel accepts, with query rows and key tile within the budgets."""
    grid = itertools.product((1, 16, 100, 2048), (1, 3, 256), (1, 4, 8), (1, 3, 512, 2048), (8, 16, 32, 64),
                             (64, 128), (jnp.float32, jnp.bfloat16))
    for tokens, seqs, group, max_pages, page_size, head_dim, dtype in grid:
        tuning = default_prefill_tuning(tokens, seqs, group, max_pages, page_size, head_dim, dtype)
        assert tuning == default_prefill_tuning(tokens, seqs, group, max_pages, page_size, head_dim, dtype)
        avals = _avals(dtype, tokens=tokens, seqs=seqs, group=group, head_dim=head_dim, page_size=page_size,
                       max_pages=max_pages)
        check_pool(*avals[:4], tuning.pages_per_block)
        slots = tuning.pages_per_block * page_size
        assert slots <= MAX_DEFAULT_KEY_SLOTS
        assert slots * head_dim * jnp.dtype(dtype).itemsize <= MAX_DEFAULT_TILE_BYTES
        assert MIN_DOT_DIM <= tuning.block_q * group or tuning.block_q == 1
        assert tuning.block_q * group <= MAX_DEFAULT_ROWS


def test_default_query_block_follows_tokens_per_sequence():
    shapes = dict(max_pages_per_seq=512, page_size=16, head_dim=128, dtype=jnp.bfloat16)
    # One long prompt: the largest block the registers allow, so its context is read the fewest times, on a
    # warpgroup (4 warps) per 64 rows.
    long_prompt = default_prefill_tuning(2048, 1, group=4, **shapes)
    assert long_prompt.block_q * 4 == MAX_DEFAULT_ROWS == 128 and long_prompt.num_warps == 8
    assert default_prefill_tuning(2048, 128, group=4, **shapes).num_warps == 4  # 16 tokens a row: 64 rows
    # One token per row (decode): the rows Triton's dot pads to anyway.
    decode = default_prefill_tuning(256, 256, group=4, **shapes)
    assert decode.block_q * 4 == MIN_DOT_DIM and decode.num_warps == 4
    assert default_prefill_tuning(256, 256, group=32, **shapes).block_q == 1


def test_default_tuning_rejects_sizes_that_are_not_positive():
    with pytest.raises(ValueError, match="default_prefill_tuning: group must be a positive int, got 0"):
        default_prefill_tuning(64, 4, 0, 32, 16, 128, jnp.bfloat16)


def test_default_tuning_matches_reference():
    step = ragged_step(13, jnp.float32, 4, 64)
    tuning = default_prefill_tuning(NUM_TOKENS, len(RAGGED_SEQUENCES) + 1, 4, MAX_PAGES, PAGE_SIZE, 64, jnp.float32)
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=0.125, tuning=tuning, interpret=True)
    assert_matches(out, reference(step, 0.125), jnp.float32)


def test_rejects_key_tile_too_small_for_triton():
    step = ragged_step(0, jnp.float32, 1, 64)
    with pytest.raises(ValueError, match="at least 16"):
        paged_prefill_attention(*step.kernel_inputs(), sm_scale=1.0, tuning=PrefillTuning(pages_per_block=1),
                                interpret=True)


def _avals(dtype, tokens=64, seqs=4, group=4, head_dim=128, num_pages=64, page_size=16, max_pages=8):
    pool = jax.ShapeDtypeStruct((KV_HEADS, num_pages, page_size, head_dim), dtype)
    ints = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    return (jax.ShapeDtypeStruct((tokens, KV_HEADS * group, head_dim), dtype), pool, pool,
            ints((seqs, max_pages)), ints((seqs,)), ints((tokens,)), ints((tokens,)))


# The Triton backend is deprecated from JAX 0.11 but is the GPU backend this kernel targets; the warning is expected.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tuning", [PrefillTuning(), PrefillTuning(block_q=1, pages_per_block=2)],
                         ids=["default", "q1"])
def test_lowers_for_cuda_through_triton(dtype, tuning):
    attend = functools.partial(paged_prefill_attention, sm_scale=0.1, logits_soft_cap=30.0, tuning=tuning)
    exported = export_for_h100(attend, *_avals(dtype))
    assert exported.platforms == ("cuda",)
    assert triton_calls(exported) == 1


@pytest.mark.parametrize("group", [1, 4])
def test_the_xla_serving_path_matches_the_kernel_reference(group):
    """The engine's XLA backend (paged_attention_xla) and the kernel's plain reference agree on a ragged step."""
    step = ragged_step(group * 64, jnp.float32, group, 64)
    xla = paged_attention_xla(step.q, step.k_pages, step.v_pages, step.metadata, step.positions, 0.125)
    assert_matches(xla, reference(step, 0.125), jnp.float32)
