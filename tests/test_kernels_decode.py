"""The Pallas paged decode kernel: interpret-mode equality with the references, and its CUDA lowering on any host.

Pools are tiny on purpose: interpret mode copies each KV head's whole pool at every grid step.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, paged_attention_xla
from jaxserve.schedule import NULL_PAGE
from kernels_pallas import DecodeTuning, default_decode_tuning, paged_decode_attention, paged_decode_reference
from kernels_pallas.common import MAX_DEFAULT_KEY_SLOTS, MAX_DEFAULT_TILE_BYTES, check_pool
from kernels_pallas.paged_decode import MAX_DEFAULT_K_SPLITS, _split_block_tables
from tests.cuda_lowering import export_for_h100, triton_calls

PAGE_SIZE = 8
MAX_PAGES = 4  # per sequence
NUM_PAGES = 32  # in the pool, null page included
KV_HEADS = 2
TUNING = DecodeTuning(pages_per_block=2)  # 16-slot key tiles: the smallest Triton's dot takes
# Lengths at every page-boundary case: empty, one token, page edges, and a full block table.
LENGTHS = (0, 1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, MAX_PAGES * PAGE_SIZE)
TOLERANCES = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _pages_needed(length: int) -> int:
    return -(-length // PAGE_SIZE)


def ragged_batch(seed: int, dtype, group: int, head_dim: int, unused_entries: str = "random"):
    """q f[S, heads, head_dim], k/v pools, block_tables i32[S, MAX_PAGES], lengths i32[S] for LENGTHS.

    Pages are drawn from a random permutation of the pool (never the null page). Free pages and the slots past each
    sequence's length hold NaN, so any read the kernel should mask shows up in the output. Block-table entries
    past a sequence's last page are random pages ("random", which the kernel must not trust) or the null page.
    """
    rng = np.random.default_rng(seed)
    seqs = len(LENGTHS)
    shape = (KV_HEADS, NUM_PAGES, PAGE_SIZE, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)  # f32[kv_heads, num_pages, page_size, head_dim]
    v_pages = np.full(shape, np.nan, np.float32)  # f32[kv_heads, num_pages, page_size, head_dim]
    k_pages[:, NULL_PAGE] = v_pages[:, NULL_PAGE] = 0.0
    owned = iter(rng.permutation(np.arange(1, NUM_PAGES)))
    if unused_entries == "random":
        block_tables = rng.integers(0, NUM_PAGES, (seqs, MAX_PAGES)).astype(np.int32)  # i32[S, MAX_PAGES]
    else:
        block_tables = np.full((seqs, MAX_PAGES), NULL_PAGE, np.int32)  # i32[S, MAX_PAGES]
    for seq, length in enumerate(LENGTHS):
        for index in range(_pages_needed(length)):
            page = next(owned)
            block_tables[seq, index] = page
            filled = min(PAGE_SIZE, length - index * PAGE_SIZE)
            k_pages[:, page, :filled] = rng.standard_normal((KV_HEADS, filled, head_dim))
            v_pages[:, page, :filled] = rng.standard_normal((KV_HEADS, filled, head_dim))
    q = rng.standard_normal((seqs, KV_HEADS * group, head_dim))  # f64[S, heads, head_dim]
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(block_tables), jnp.asarray(LENGTHS, jnp.int32))


def assert_matches(actual: jax.Array, expected: jax.Array, dtype):
    assert actual.dtype == expected.dtype == dtype
    assert not jnp.isnan(actual).any(), "masked NaN reached the output"
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (2, 64), (4, 64), (8, 64), (4, 128)])
def test_kernel_matches_reference_on_ragged_batch(dtype, group, head_dim):
    batch = ragged_batch(group, dtype, group, head_dim)
    scale = head_dim ** -0.5
    out = paged_decode_attention(*batch, sm_scale=scale, tuning=TUNING, interpret=True)
    assert_matches(out, paged_decode_reference(*batch, sm_scale=scale), dtype)
    assert not out[LENGTHS.index(0)].any(), "a length-0 sequence must give zeros"


@pytest.mark.parametrize("tuning", [DecodeTuning(pages_per_block=2, k_splits=2),
                                    DecodeTuning(pages_per_block=2, k_splits=3),
                                    DecodeTuning(pages_per_block=4)], ids=["2splits", "3splits", "4pages"])
def test_tunings_agree(tuning):
    """Split-K (dividing the table evenly or not) and wider blocks change only the schedule, not the result."""
    batch = ragged_batch(7, jnp.float32, 4, 64)
    out = paged_decode_attention(*batch, sm_scale=0.125, tuning=tuning, interpret=True)
    assert_matches(out, paged_decode_reference(*batch, sm_scale=0.125), jnp.float32)


def test_logits_soft_cap():
    batch = ragged_batch(3, jnp.float32, 2, 64)
    # A large scale makes raw scores reach tens, where the cap changes the result.
    out = paged_decode_attention(*batch, sm_scale=2.0, logits_soft_cap=5.0, tuning=TUNING, interpret=True)
    expected = paged_decode_reference(*batch, sm_scale=2.0, logits_soft_cap=5.0)
    assert_matches(out, expected, jnp.float32)
    assert not np.allclose(expected, paged_decode_reference(*batch, sm_scale=2.0), atol=1e-3)


def test_matches_serving_reference_on_decode_metadata():
    """Decode-only metadata (one token per sequence, at position length - 1) gives the serving oracle's output."""
    q, k_pages, v_pages, block_tables, lengths = ragged_batch(5, jnp.float32, 2, 64, unused_entries="null")
    seqs = len(LENGTHS)
    metadata = PagedAttentionMetadata(
        slot_mapping=jnp.full((seqs,), -1, jnp.int32),  # i32[S]: nothing is written
        token_seq=jnp.arange(seqs, dtype=jnp.int32),  # i32[S]
        block_tables=block_tables,
        seq_lens=lengths,
    )
    expected = paged_attention_xla(q, k_pages, v_pages, metadata, jnp.maximum(lengths - 1, 0), 0.125)
    out = paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, sm_scale=0.125, tuning=TUNING,
                                 interpret=True)
    assert_matches(out, expected, jnp.float32)


@pytest.mark.parametrize("field, value, message", [
    ("pages_per_block", 3, "power of two"),
    ("num_warps", 6, "power of two"),
    ("pages_per_block", 0, "positive int"),
    ("k_splits", 0, "positive int"),
    ("k_splits", True, "positive int"),
    ("num_warps", "4", "positive int"),
    ("num_stages", 1.5, "positive int"),
])
def test_tuning_rejects_invalid_values(field, value, message):
    with pytest.raises(ValueError, match=f"DecodeTuning.{field}.*{message}"):
        DecodeTuning(**{field: value})


def test_default_tuning_is_valid_over_serving_shapes():
    """Every shape gets a tuning the kernel accepts, with a key tile within the budgets and no split left empty."""
    grid = itertools.product((1, 2, 3, 17, 64, 256), (1, 8), (1, 2, 3, 100, 512, 2048), (8, 16, 32, 64), (64, 128),
                             (jnp.float32, jnp.bfloat16))
    for seqs, kv_heads, max_pages, page_size, head_dim, dtype in grid:
        tuning = default_decode_tuning(seqs, kv_heads, max_pages, page_size, head_dim, dtype)
        assert tuning == default_decode_tuning(seqs, kv_heads, max_pages, page_size, head_dim, dtype)
        q, k_pages, v_pages, block_tables, _ = _avals(dtype, seqs=seqs, head_dim=head_dim, page_size=page_size,
                                                      max_pages=max_pages)
        check_pool(q, k_pages, v_pages, block_tables, tuning.pages_per_block)
        slots = tuning.pages_per_block * page_size
        assert slots <= MAX_DEFAULT_KEY_SLOTS
        assert slots * head_dim * jnp.dtype(dtype).itemsize <= MAX_DEFAULT_TILE_BYTES
        assert 1 <= tuning.k_splits <= MAX_DEFAULT_K_SPLITS
        pages_per_split = jax.eval_shape(functools.partial(_split_block_tables, tuning=tuning), block_tables).shape[2]
        assert (tuning.k_splits - 1) * pages_per_split < max_pages, "a split past every table's end"


def test_default_tuning_splits_only_few_long_sequences():
    long_context = dict(kv_heads=8, max_pages_per_seq=512, page_size=16, head_dim=128, dtype=jnp.bfloat16)
    assert default_decode_tuning(num_seqs=1, **long_context).k_splits > 1
    assert default_decode_tuning(num_seqs=256, **long_context).k_splits == 1
    # A table of one key tile has nothing to split, however few the sequences.
    assert default_decode_tuning(1, 8, max_pages_per_seq=4, page_size=16, head_dim=128, dtype=jnp.bfloat16
                                 ).k_splits == 1


@pytest.mark.parametrize("argument", ["num_seqs", "max_pages_per_seq", "page_size", "num_cores"])
def test_default_tuning_rejects_sizes_that_are_not_positive(argument):
    sizes = dict(num_seqs=4, kv_heads=8, max_pages_per_seq=64, page_size=16, head_dim=128, num_cores=132)
    with pytest.raises(ValueError, match=f"default_decode_tuning: {argument} must be a positive int, got 0"):
        default_decode_tuning(**{**sizes, argument: 0}, dtype=jnp.bfloat16)


def test_rejects_key_tile_too_small_for_triton():
    batch = ragged_batch(0, jnp.float32, 1, 64)
    with pytest.raises(ValueError, match="at least 16"):
        paged_decode_attention(*batch, sm_scale=1.0, tuning=DecodeTuning(pages_per_block=1), interpret=True)


def _avals(dtype, seqs=4, group=4, head_dim=128, num_pages=64, page_size=16, max_pages=8):
    pool = jax.ShapeDtypeStruct((KV_HEADS, num_pages, page_size, head_dim), dtype)
    return (jax.ShapeDtypeStruct((seqs, KV_HEADS * group, head_dim), dtype), pool, pool,
            jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32), jax.ShapeDtypeStruct((seqs,), jnp.int32))


# The Triton backend is deprecated from JAX 0.11 but is the GPU backend this kernel targets; the warning is expected.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tuning", [DecodeTuning(), DecodeTuning(k_splits=4, pages_per_block=2)],
                         ids=["default", "4splits"])
def test_lowers_for_cuda_through_triton(dtype, tuning):
    attend = functools.partial(paged_decode_attention, sm_scale=0.1, logits_soft_cap=30.0, tuning=tuning)
    exported = export_for_h100(attend, *_avals(dtype))
    assert exported.platforms == ("cuda",)
    assert triton_calls(exported) == 1
