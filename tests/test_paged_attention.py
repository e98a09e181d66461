"""The paged KV cache against the dense one: the XLA reference attention, the in-step writes, the model end to end,
and the donated pool updated in place."""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.paged_kv_cache import PagedKVCache, paged_attention_xla
from jaxserve.reference.dense_kv_cache import DenseKVCache, dense_causal_attention
from jaxserve.runner.paged_inputs import ChunkLayout, PagedInputs, build_metadata
from jaxserve.schedule import NULL_PAGE


class Chunk(NamedTuple):
    """A scheduled chunk as build_metadata reads it."""

    start_position: int  # tokens already cached
    num_tokens: int  # tokens computed this step
    page_ids: list[int]  # the sequence's pages


PAGE_SIZE = 4
MAX_PAGES = 5  # longest sequence: MAX_PAGES * PAGE_SIZE tokens
KV_HEADS = 2
FREE_PAGES = 6  # pages no sequence owns, poisoned with NaN
PADDING_VALUE = 1e3  # K/V of padding tokens: finite, and visible in the pool if ever written
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # atol = rtol, against the dense path in the same dtype

# (sequence length after the step, query tokens this step): lengths 0, 1, page-1, page, page+1 and max, as decode
# tokens (one query), whole prompts, and prefill chunks that continue after cached context.
RAGGED_SEQUENCES = ((0, 0), (1, 1), (PAGE_SIZE - 1, 1), (PAGE_SIZE, PAGE_SIZE), (PAGE_SIZE + 1, 3),
                    (MAX_PAGES * PAGE_SIZE, 1), (13, 6), (MAX_PAGES * PAGE_SIZE, 7))
NUM_TOKENS = 24  # T bucket: 23 real tokens and one padding token
NUM_SEQS = len(RAGGED_SEQUENCES) + 1  # S bucket: one padding row


@dataclasses.dataclass(frozen=True)
class RaggedSequence:
    """One sequence of a random step: all its K/V so far and this step's queries."""

    chunk: Chunk  # where this step's tokens start, how many, and the sequence's pages
    keys: np.ndarray  # f32[length, kv_heads, head_dim], rounded to the test dtype
    values: np.ndarray  # f32[length, kv_heads, head_dim]
    queries: np.ndarray  # f32[num_tokens, heads, head_dim]


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """A random ragged step over a NaN-poisoned pool, and what the dense path says it should produce."""

    pool: PagedKVCache  # the step's metadata attached; earlier chunks' K/V written, everything else NaN but page 0
    inputs: PagedInputs  # host metadata and positions i32[T]
    q: jax.Array  # f[T, heads, head_dim]
    k: jax.Array  # f[T, kv_heads, head_dim]: this step's keys (PADDING_VALUE for padding tokens)
    v: jax.Array  # f[T, kv_heads, head_dim]
    expected_out: np.ndarray  # f32[real tokens, heads, head_dim] from dense_causal_attention
    expected_k_pages: np.ndarray  # f32[kv_heads, num_pages, page_size, head_dim]: the pool after the step's writes
    expected_v_pages: np.ndarray  # f32[kv_heads, num_pages, page_size, head_dim]


def make_ragged_batch(seed: int, group: int, head_dim: int, dtype) -> RaggedBatch:
    rng = np.random.default_rng(seed)
    num_pages = 1 + sum(_pages_for(length) for length, _ in RAGGED_SEQUENCES) + FREE_PAGES
    shuffled_pages = iter(rng.permutation(np.arange(1, num_pages)))
    sequences = []
    for length, num_tokens in RAGGED_SEQUENCES:
        pages = [int(next(shuffled_pages)) for _ in range(_pages_for(length))]
        keys, values = (_random(rng, (length, KV_HEADS, head_dim), dtype) for _ in "kv")
        queries = _random(rng, (num_tokens, KV_HEADS * group, head_dim), dtype)
        sequences.append(RaggedSequence(Chunk(length - num_tokens, num_tokens, pages), keys, values, queries))
    inputs = build_metadata([s.chunk for s in sequences], num_tokens=NUM_TOKENS, num_seqs=NUM_SEQS,
                            max_pages=MAX_PAGES, page_size=PAGE_SIZE)
    padding = NUM_TOKENS - sum(s.chunk.num_tokens for s in sequences)
    padding_q = _random(rng, (padding, KV_HEADS * group, head_dim), dtype)
    padding_kv = np.full((padding, KV_HEADS, head_dim), PADDING_VALUE)
    cached_k, cached_v = _host_pool(sequences, num_pages, head_dim, cached_only=True)
    # One layer: f[kv_heads, 1, num_pages, page_size, head_dim].
    pool = PagedKVCache(k_pages=jnp.asarray(cached_k, dtype)[:, None], v_pages=jnp.asarray(cached_v, dtype)[:, None])
    expected_k, expected_v = _host_pool(sequences, num_pages, head_dim, cached_only=False)
    return RaggedBatch(
        pool=pool.with_metadata(jax.tree.map(jnp.asarray, inputs.metadata)),
        inputs=inputs,
        q=jnp.asarray(np.concatenate([s.queries for s in sequences] + [padding_q]), dtype),
        k=jnp.asarray(np.concatenate([s.keys[s.chunk.start_position:] for s in sequences] + [padding_kv]), dtype),
        v=jnp.asarray(np.concatenate([s.values[s.chunk.start_position:] for s in sequences] + [padding_kv]), dtype),
        expected_out=_dense_attention(sequences, dtype),
        expected_k_pages=expected_k,
        expected_v_pages=expected_v,
    )


def _pages_for(length: int, page_size: int = PAGE_SIZE) -> int:
    return -(-length // page_size)


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """Normal samples rounded to dtype, kept as float32 so the host can compare exactly."""
    return rng.normal(size=shape).astype(dtype).astype(np.float32)


def _host_pool(sequences: list[RaggedSequence], num_pages: int, head_dim: int, cached_only: bool):
    """(K, V) pools f32[kv_heads, num_pages, page_size, head_dim] written on the host: NaN except the null page
    and the sequences' tokens (only those before this step's chunk if cached_only)."""
    pools = [np.full((KV_HEADS, num_pages, PAGE_SIZE, head_dim), np.nan, np.float32) for _ in "kv"]
    for pool in pools:
        pool[:, NULL_PAGE] = 0.0
    for seq in sequences:
        end = seq.chunk.start_position if cached_only else len(seq.keys)
        for position in range(end):
            page, offset = seq.chunk.page_ids[position // PAGE_SIZE], position % PAGE_SIZE
            pools[0][:, page, offset], pools[1][:, page, offset] = seq.keys[position], seq.values[position]
    return pools


def _dense_attention(sequences: list[RaggedSequence], dtype) -> np.ndarray:  # f32[real tokens, heads, head_dim]
    """Every sequence as one row of a dense batch (zero-padded), the dense cache's attention, real rows kept."""
    rows = [seq for seq in sequences if seq.chunk.num_tokens]
    max_tokens = max(seq.chunk.num_tokens for seq in rows)
    q, keys, values, positions = _stack_padded(rows, max_tokens)
    out = dense_causal_attention(jnp.asarray(q, dtype), jnp.asarray(keys, dtype), jnp.asarray(values, dtype),
                                 jnp.asarray(positions), scale=q.shape[-1] ** -0.5)
    out = np.asarray(out.astype(jnp.float32))  # f32[rows, max_tokens, heads, head_dim]
    return np.concatenate([out[i, : seq.chunk.num_tokens] for i, seq in enumerate(rows)])


def _stack_padded(rows: list[RaggedSequence], max_tokens: int):
    """Queries f32[rows, max_tokens, heads, D], K and V f32[rows, max_len, kv_heads, D], positions i32[rows, ...]."""
    max_len = MAX_PAGES * PAGE_SIZE
    q = np.zeros((len(rows), max_tokens, *rows[0].queries.shape[1:]), np.float32)
    keys = np.zeros((len(rows), max_len, *rows[0].keys.shape[1:]), np.float32)
    values = np.zeros_like(keys)
    positions = np.zeros((len(rows), max_tokens), np.int32)
    for i, seq in enumerate(rows):
        start, count = seq.chunk.start_position, seq.chunk.num_tokens
        q[i, :count], positions[i, :count] = seq.queries, np.arange(start, start + count)
        keys[i, : len(seq.keys)], values[i, : len(seq.values)] = seq.keys, seq.values
    return q, keys, values, positions


@functools.partial(jax.jit, static_argnames="scale")
def _write_and_attend(pool: PagedKVCache, q, k, v, positions, scale):
    out, pool = pool.update_and_attend(0, q[None], k[None], v[None], positions[None], scale)
    return out[0], pool


def _assert_close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_paged_step_matches_dense_attention_and_writes_only_real_tokens(group, head_dim, dtype):
    batch = make_ragged_batch(seed=group * head_dim, group=group, head_dim=head_dim, dtype=dtype)
    out, pool = _write_and_attend(batch.pool, batch.q, batch.k, batch.v, jnp.asarray(batch.inputs.positions),
                                  scale=head_dim**-0.5)
    real_tokens = len(batch.expected_out)
    _assert_close(out[:real_tokens], batch.expected_out, dtype)
    np.testing.assert_array_equal(np.asarray(out[real_tokens:], np.float32), 0.0)  # padding: zeros, not NaN
    # Bit-exact, NaN-aware: the step's tokens landed in their slots, the null page and free slots are untouched.
    np.testing.assert_array_equal(np.asarray(pool.k_pages[:, 0], np.float32), batch.expected_k_pages)
    np.testing.assert_array_equal(np.asarray(pool.v_pages[:, 0], np.float32), batch.expected_v_pages)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3, MAX_PAGES])
def test_reference_agrees_for_every_block_size(pages_per_block):
    batch = make_ragged_batch(seed=pages_per_block, group=2, head_dim=64, dtype=jnp.float32)
    _, pool = _write_and_attend(batch.pool, batch.q, batch.k, batch.v, jnp.asarray(batch.inputs.positions),
                                scale=64**-0.5)
    out = paged_attention_xla(batch.q, pool.k_pages[:, 0], pool.v_pages[:, 0], pool.metadata,
                                    jnp.asarray(batch.inputs.positions), 64**-0.5, pages_per_block=pages_per_block)
    _assert_close(out[: len(batch.expected_out)], batch.expected_out, jnp.float32)


def test_all_padding_step_returns_zeros_and_leaves_the_pool_alone():
    pool = PagedKVCache.zeros(1, num_pages=3, page_size=PAGE_SIZE, kv_heads=KV_HEADS, head_dim=8, dtype=jnp.float32)
    inputs = build_metadata([], num_tokens=4, num_seqs=2, max_pages=2, page_size=PAGE_SIZE)
    pool = pool.with_metadata(jax.tree.map(jnp.asarray, inputs.metadata))
    q = jnp.ones((4, KV_HEADS, 8))
    k = v = jnp.full((4, KV_HEADS, 8), PADDING_VALUE)
    out, new_pool = _write_and_attend(pool, q, k, v, jnp.asarray(inputs.positions), scale=1.0)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(new_pool.k_pages[:, 0], 0.0)
    np.testing.assert_array_equal(new_pool.v_pages[:, 0], 0.0)


def test_build_metadata_lays_out_tokens_slots_and_padding():
    inputs = build_metadata([Chunk(0, 5, [3, 5]), Chunk(2, 1, [1])], num_tokens=8, num_seqs=4,
                            max_pages=3, page_size=4)
    np.testing.assert_array_equal(inputs.positions, [0, 1, 2, 3, 4, 2, 0, 0])
    np.testing.assert_array_equal(inputs.metadata.slot_mapping, [12, 13, 14, 15, 20, 6, -1, -1])
    np.testing.assert_array_equal(inputs.metadata.token_seq, [0, 0, 0, 0, 0, 1, 2, 2])
    np.testing.assert_array_equal(inputs.metadata.block_tables, [[3, 5, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(inputs.metadata.seq_lens, [5, 3, 0, 0])


@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [1], [3, 1, 2], [1, 4, 1, 1], []])
def test_chunk_layout_places_every_token_as_a_plain_walk_does(counts):
    """ChunkLayout (with its shortcut for decode steps, one token per chunk) against a token-by-token walk."""
    chunks = [Chunk(5 * i + 2, count, [i + 1]) for i, count in enumerate(counts)]
    layout = ChunkLayout.of(chunks)
    walk = [(row, chunk.start_position + k) for row, chunk in enumerate(chunks) for k in range(chunk.num_tokens)]
    np.testing.assert_array_equal(layout.token_rows, np.array([row for row, _ in walk], np.int32).reshape(-1))
    np.testing.assert_array_equal(layout.positions, np.array([pos for _, pos in walk], np.int32).reshape(-1))
    np.testing.assert_array_equal(layout.first_token, np.cumsum([0, *counts])[:-1])
    np.testing.assert_array_equal(layout.last_token, np.cumsum(counts) - 1)
    np.testing.assert_array_equal(layout.num_pages, [1] * len(counts))
    assert layout.num_tokens == sum(counts)


@pytest.mark.parametrize("chunks, num_seqs, message", [
    ([Chunk(0, 5, [1])], 2, "needs 2 pages"),
    ([Chunk(0, 3, [0])], 2, "null page"),
    ([Chunk(0, 9, [1, 2, 3])], 2, "do not fit"),
])
def test_build_metadata_rejects_what_the_step_cannot_run(chunks, num_seqs, message):
    with pytest.raises(ValueError, match=message):
        build_metadata(chunks, num_tokens=8, num_seqs=num_seqs, max_pages=3, page_size=4)


def test_padding_tokens_without_a_spare_row_read_the_last_row_and_never_write():
    inputs = build_metadata([Chunk(0, 3, [1])], num_tokens=8, num_seqs=1, max_pages=3, page_size=4)
    np.testing.assert_array_equal(inputs.metadata.token_seq, [0] * 8)
    np.testing.assert_array_equal(inputs.metadata.slot_mapping, [4, 5, 6] + [-1] * 5)


def test_cache_refuses_unknown_backends_and_missing_metadata():
    with pytest.raises(ValueError, match="unknown attention backend"):
        PagedKVCache.zeros(1, 2, 4, 1, 8, jnp.float32, attention_backend="nonexistent")
    pool = PagedKVCache.zeros(1, 2, 4, 1, 8, jnp.float32)
    x = jnp.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="no metadata"):
        pool.update_and_attend(0, x, x, x, jnp.zeros((1, 2), jnp.int32), 1.0)


@pytest.mark.parametrize("name, interpret, platform, resolved", [
    ("auto", False, "gpu", "pallas"),
    ("auto", False, "cpu", "xla"),
    ("auto", False, "tpu", "xla"),
    ("auto", True, "cpu", "pallas-interpret"),
    ("auto", True, "gpu", "pallas-interpret"),
    ("pallas", False, "gpu", "pallas"),
    ("pallas", True, "cpu", "pallas-interpret"),
    ("xla", False, "gpu", "xla"),
])
def test_attention_backend_choice_resolves_per_platform(name, interpret, platform, resolved):
    assert _attention_on(name, interpret, platform) == resolved


@pytest.mark.parametrize("name, interpret, platform, message", [
    ("triton", False, "gpu", r"unknown attention backend 'triton' \(choose from auto, pallas, xla\)"),
    ("pallas-interpret", False, "cpu", "unknown attention backend"),
    ("xla", True, "cpu", "does not apply to the xla attention backend"),
    ("pallas", False, "cpu", "--pallas-interpret"),
])
def test_attention_backend_choice_rejects_what_cannot_run(name, interpret, platform, message):
    with pytest.raises(ConfigError, match=message):
        _attention_on(name, interpret, platform)


def _attention_on(name: str, interpret: bool, platform: str) -> str:
    return EngineConfig(attention_backend=name, pallas_interpret=interpret).attention_implementation(platform)


# The model end to end: three sequences, their prompts prefilled in chunks, then decoded, through one pool.
MODEL_PAGE_SIZE = 4
MODEL_MAX_PAGES = 4
SEQUENCE_TOKENS = (13, 9, 6)  # every token each sequence will have, prompt and "generated"
# Per step: (tokens, sequence rows) buckets and each sequence's (start, count).
MODEL_STEPS = (
    ((16, 4), ((0, 5), (0, 6), (0, 3))),  # A's first prefill chunk, B's and C's whole prompts
    ((12, 4), ((5, 6), (6, 1), (3, 1))),  # A's second chunk after cached context; B and C decode
    ((4, 4), ((11, 1), (7, 1), (4, 1))),  # everyone decodes
)


def tiny_llama() -> LlamaForCausalLM:
    """Two layers, GQA (4 query heads over 2 KV heads), float32, weights large enough for decisive logits."""
    config = LlamaConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    ))
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0), init_std=0.2)


def _paged_forward(graphdef, params, tokens, inputs: PagedInputs, pool: PagedKVCache):
    """One engine-style step: tokens i32[T] → logits f32[T, vocab], and the pool updated (metadata stripped)."""
    model = nnx.merge(graphdef, params)
    hidden, cache = model(tokens[None], inputs.positions[None], pool.with_metadata(inputs.metadata))
    return model.logits(hidden[0]), cache.without_metadata()


def _jitted_paged_forward(graphdef):
    return jax.jit(functools.partial(_paged_forward, graphdef), donate_argnames="pool")


@functools.partial(jax.jit, static_argnums=0)
def _dense_logits(graphdef, params, tokens: jax.Array) -> jax.Array:  # f32[batch, tokens, vocab]
    """Right-padded sequences i32[batch, tokens], each a row of the dense cache, all their tokens at once."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    batch, length = tokens.shape
    cache = DenseKVCache.zeros(cfg.num_hidden_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim,
                               jnp.float32)
    hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(length), tokens.shape), cache)
    return model.logits(hidden)


def _poisoned_pool(model: LlamaForCausalLM, num_pages: int) -> PagedKVCache:
    """A pool whose every page but the null page holds NaN: a slot read before it is written poisons the logits."""
    cfg = model.config
    pool = PagedKVCache.zeros(cfg.num_hidden_layers, num_pages, MODEL_PAGE_SIZE, cfg.num_key_value_heads,
                              cfg.head_dim, jnp.float32)
    return jax.tree.map(lambda pages: pages.at[:, :, NULL_PAGE + 1:].set(jnp.nan), pool)


def test_model_on_paged_ragged_steps_matches_each_sequence_alone_on_the_dense_cache():
    model = tiny_llama()
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, model.config.vocab_size, size=n).astype(np.int32) for n in SEQUENCE_TOKENS]
    num_pages = 1 + sum(_pages_for(n, MODEL_PAGE_SIZE) for n in SEQUENCE_TOKENS)
    shuffled = iter(rng.permutation(np.arange(1, num_pages)))
    page_lists = [[int(next(shuffled)) for _ in range(_pages_for(n, MODEL_PAGE_SIZE))] for n in SEQUENCE_TOKENS]
    # Causal attention: right padding never changes a real token's logits.
    expected_logits = np.asarray(_dense_logits(graphdef, params, jnp.asarray(_right_padded(sequences))))
    forward = _jitted_paged_forward(graphdef)
    pool = _poisoned_pool(model, num_pages)
    for (num_tokens, num_seqs), schedule in MODEL_STEPS:
        chunks = [Chunk(start, count, pages[: _pages_for(start + count, MODEL_PAGE_SIZE)])
                  for (start, count), pages in zip(schedule, page_lists)]
        inputs = build_metadata(chunks, num_tokens=num_tokens, num_seqs=num_seqs, max_pages=MODEL_MAX_PAGES,
                                page_size=MODEL_PAGE_SIZE)
        step_tokens = np.zeros(num_tokens, np.int32)
        step_tokens[: sum(count for _, count in schedule)] = np.concatenate(
            [seq[start:start + count] for seq, (start, count) in zip(sequences, schedule)])
        logits, pool = forward(params, jnp.asarray(step_tokens), jax.tree.map(jnp.asarray, inputs), pool)
        first = 0
        for expected, (start, count) in zip(expected_logits, schedule):  # f32[max tokens, vocab] per sequence
            np.testing.assert_allclose(logits[first:first + count], expected[start:start + count], atol=1e-4,
                                       rtol=1e-4)
            first += count
        assert np.isfinite(np.asarray(logits)).all()  # padding tokens included


def _right_padded(sequences: list[np.ndarray]) -> np.ndarray:  # i32[len(sequences), longest]
    padded = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, seq in zip(padded, sequences):
        row[: len(seq)] = seq
    return padded


def test_pool_is_donated_and_updated_in_place():
    model = tiny_llama()
    graphdef, params = nnx.split(model)
    pool = _poisoned_pool(model, num_pages=6)
    inputs = build_metadata([Chunk(0, 5, [2, 4])], num_tokens=8, num_seqs=2, max_pages=2, page_size=4)
    inputs = jax.tree.map(jnp.asarray, inputs)
    tokens = jnp.arange(8, dtype=jnp.int32)
    forward = _jitted_paged_forward(graphdef)
    lowered = forward.lower(params, tokens, inputs, pool)
    pool_arrays = len(jax.tree.leaves(pool))
    assert lowered.as_text().count("tf.aliasing_output") == pool_arrays
    pool_bytes = sum(pages.nbytes for pages in jax.tree.leaves(pool))
    assert lowered.compile().memory_analysis().alias_size_in_bytes == pool_bytes
    _, new_pool = forward(params, tokens, inputs, pool)
    assert all(pages.is_deleted() for pages in jax.tree.leaves(pool))
    assert not any(pages.is_deleted() for pages in jax.tree.leaves(new_pool))

