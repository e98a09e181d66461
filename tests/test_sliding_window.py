"""Sliding-window attention in every attention path: the Pallas kernels (interpret mode) against their plain
references, the engine's XLA backend against the same references, the references against a dense oracle written
from transformers' rule (a query at position p sees keys at positions > p - window), and the kernels' CUDA lowering.

The ragged steps and batches are the kernel tests' own (NaN-poisoned free pages, shuffled pages, padding rows).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.paged_kv_cache import paged_attention_xla
from kernels_pallas import (DecodeTuning, PrefillTuning, paged_decode_attention, paged_decode_reference,
                            paged_prefill_attention, paged_prefill_reference)
from tests.cuda_lowering import export_for_h100, triton_calls
from tests.test_kernels_decode import ragged_batch
from tests.test_kernels_prefill import PAGE_SIZE, _avals, assert_matches, ragged_step, real_tokens

# Windows of one slot, shorter than a page, a page, a 16-slot key tile and between tiles, and wider than any sequence.
WINDOWS = (1, 3, PAGE_SIZE, 16, 17, 1000)
PREFILL_TUNINGS = (PrefillTuning(block_q=4, pages_per_block=2), PrefillTuning(block_q=16, pages_per_block=2))
SCALE = 0.125


def dense_oracle(q, k_pages, v_pages, block_tables, seq_lens, token_seq, positions, window: int) -> np.ndarray:
    """f32[T, heads, head_dim]: each token over its sequence's keys at positions p' with p - window < p' <= p (and
    p' < the sequence's length), one token at a time in numpy."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    tokens, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    out = np.zeros((tokens, heads, head_dim))
    for t in range(tokens):
        row, position = int(token_seq[t]), int(positions[t])
        keys_seen = [p for p in range(min(position + 1, int(seq_lens[row]))) if p > position - window]
        if not keys_seen:
            continue
        pages = [int(block_tables[row, p // page_size]) for p in keys_seen]
        offsets = [p % page_size for p in keys_seen]
        for head in range(heads):
            kv = head // (heads // kv_heads)
            keys, values = k_pages[kv, pages, offsets], v_pages[kv, pages, offsets]  # f64[seen, head_dim]
            scores = keys @ q[t, head] * SCALE
            probs = np.exp(scores - scores.max())
            out[t, head] = probs @ values / probs.sum()
    return out


def prefill_reference(step, window):
    m = step.metadata
    return paged_prefill_reference(step.q, step.k_pages, step.v_pages, m.block_tables, m.seq_lens, m.token_seq,
                                   step.positions, sm_scale=SCALE, sliding_window=window)


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_reference_matches_the_dense_oracle(window):
    step = ragged_step(window, jnp.float32, 2, 64)
    expected = dense_oracle(*step.kernel_inputs(), window)
    np.testing.assert_allclose(np.asarray(prefill_reference(step, window)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tuning", PREFILL_TUNINGS, ids=["q4", "q16"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_kernel_matches_reference_with_a_window(window, group, tuning):
    step = ragged_step(window + group, jnp.float32, group, 64)
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=SCALE, sliding_window=window, tuning=tuning,
                                  interpret=True)
    assert_matches(out, prefill_reference(step, window), jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[real_tokens():]), 0.0)  # padding tokens: zeros


def test_prefill_kernel_with_a_window_in_bfloat16():
    step = ragged_step(5, jnp.bfloat16, 4, 64)
    out = paged_prefill_attention(*step.kernel_inputs(), sm_scale=SCALE, sliding_window=5,
                                  tuning=PREFILL_TUNINGS[0], interpret=True)
    assert_matches(out, prefill_reference(step, 5), jnp.bfloat16)


def test_a_window_changes_what_long_contexts_see():
    """The masking is real: with a window shorter than the contexts the output differs from full attention, and a
    window wider than every context gives full attention exactly."""
    step = ragged_step(1, jnp.float32, 2, 64)
    full = np.asarray(prefill_reference(step, None))
    assert not np.allclose(np.asarray(prefill_reference(step, 3)), full, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(prefill_reference(step, 1000)), full)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_xla_serving_path_matches_the_reference_with_a_window(window):
    step = ragged_step(window, jnp.float32, 4, 64)
    # Small blocks, so the loop's first block moves with the window.
    xla = paged_attention_xla(step.q, step.k_pages, step.v_pages, step.metadata, step.positions, SCALE,
                              jnp.int32(window), pages_per_block=1)
    assert_matches(xla, prefill_reference(step, window), jnp.float32)


@pytest.mark.parametrize("k_splits", [1, 2])
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_kernel_matches_reference_with_a_window(window, k_splits):
    q, k_pages, v_pages, block_tables, lengths = ragged_batch(window, jnp.float32, 4, 64)
    out = paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, sm_scale=SCALE, sliding_window=window,
                                 tuning=DecodeTuning(pages_per_block=2, k_splits=k_splits), interpret=True)
    expected = paged_decode_reference(q, k_pages, v_pages, block_tables, lengths, sm_scale=SCALE,
                                      sliding_window=window)
    assert_matches(out, expected, jnp.float32)
    seqs = q.shape[0]
    oracle = dense_oracle(q, k_pages, v_pages, block_tables, lengths, np.arange(seqs), np.maximum(lengths - 1, 0),
                          window)
    np.testing.assert_allclose(np.asarray(expected), oracle, atol=1e-5, rtol=1e-5)


def test_one_program_serves_every_window():
    """The window is an input, not a constant: layers of different windows share the compiled kernel."""
    step = ragged_step(2, jnp.float32, 2, 64)
    attend = jax.jit(functools.partial(paged_prefill_attention, sm_scale=SCALE, tuning=PREFILL_TUNINGS[0],
                                       interpret=True))
    for window in (3, 9):
        assert_matches(attend(*step.kernel_inputs(), sliding_window=jnp.int32(window)),
                       prefill_reference(step, window), jnp.float32)
    assert attend._cache_size() == 1


@pytest.mark.parametrize("window", [jnp.array([3, 4], jnp.int32), 2.5])
def test_kernels_refuse_a_window_that_is_not_an_integer_scalar(window):
    step = ragged_step(0, jnp.float32, 1, 64)
    with pytest.raises(ValueError, match="sliding_window must be None or an integer scalar"):
        paged_prefill_attention(*step.kernel_inputs(), sm_scale=SCALE, sliding_window=window, interpret=True)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_windowed_kernels_lower_for_cuda_through_triton():
    prefill = functools.partial(paged_prefill_attention, sm_scale=0.1, sliding_window=jnp.int32(64))
    assert triton_calls(export_for_h100(prefill, *_avals(jnp.bfloat16))) == 1
    decode_avals = _avals(jnp.bfloat16, tokens=4, seqs=4)[:5]
    decode = functools.partial(paged_decode_attention, sm_scale=0.1, sliding_window=jnp.int32(64),
                               tuning=DecodeTuning(pages_per_block=2, k_splits=2))
    assert triton_calls(export_for_h100(decode, *decode_avals)) == 1
