"""The decoder stack is one scanned layer over stacked weights, and the pool is indexed, never sliced, per layer:
a step's program and workspace grow neither with depth nor with the pool."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig
from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, PagedKVCache, write_slots
from jaxserve.runner.model_runner import ModelRunner

TOKENS, SEQS, MAX_PAGES, PAGE_SIZE = 16, 2, 8, 8


def _config(num_layers: int) -> LlamaConfig:
    return LlamaConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    ))


def _lowered_step(num_layers: int) -> str:
    """StableHLO of one paged forward step of a random model of `num_layers` layers."""
    cfg = _config(num_layers)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg)))
    pool = jax.eval_shape(lambda: PagedKVCache.zeros(num_layers, 16, PAGE_SIZE, 2, cfg.head_dim, jnp.float32))
    ids = jax.ShapeDtypeStruct((TOKENS,), jnp.int32)
    metadata = PagedAttentionMetadata(slot_mapping=ids, token_seq=ids, seq_lens=jax.ShapeDtypeStruct((SEQS,), jnp.int32),
                                      block_tables=jax.ShapeDtypeStruct((SEQS, MAX_PAGES), jnp.int32))

    def forward(params, pool, tokens, positions, metadata):
        hidden, cache = nnx.merge(graphdef, params)(tokens[None], positions[None], pool.with_metadata(metadata))
        return hidden, cache.without_metadata()

    return jax.jit(forward).lower(params, pool, ids, ids, metadata).as_text()


def test_the_step_program_holds_one_layer_whatever_the_depth():
    shallow, deep = _lowered_step(2), _lowered_step(16)
    count = lambda text, op: len(re.findall(rf"\b{op}\b", text))  # noqa: E731
    for op in ("stablehlo.dot_general", "stablehlo.scatter", "stablehlo.gather"):
        assert count(deep, op) == count(shallow, op) > 0, op
    assert len(deep) < 1.05 * len(shallow)


def test_no_step_program_s_workspace_grows_with_the_pool():
    """Were a layer's pages sliced out of the pool (into a kernel, or out of a scan iteration), or the pool copied
    (XLA turns a one-token write into a bounds-checked dynamic-update-slice that keeps the old pool alive), XLA would
    need a temporary of that size: the workspace would grow with the pool. Every bucket, the one-token step's
    included."""
    builtin = load_model(None, "float32", progress=False)
    config = EngineConfig(max_num_seqs=SEQS, max_num_batched_tokens=TOKENS, max_model_len=64, block_size=PAGE_SIZE)
    runner = ModelRunner(builtin.config, builtin.graphdef, builtin.params, builtin.dtype, config)
    large_pool_pages = 8192
    cfg = builtin.config
    one_layer_slice = cfg.num_key_value_heads * large_pool_pages * PAGE_SIZE * cfg.head_dim * jnp.dtype(
        builtin.dtype).itemsize  # bytes of one layer's K pages
    buckets = runner.buckets.all_buckets()
    assert min(bucket.num_tokens for bucket in buckets) == 1
    for bucket in buckets:
        small, large = runner.programs.workspace_bytes(bucket, 2), runner.programs.workspace_bytes(bucket, large_pool_pages)
        assert large - small < one_layer_slice // 100, bucket
        assert large < one_layer_slice // 4, bucket
    assert runner.programs.largest_workspace_bytes(large_pool_pages) < one_layer_slice // 4


@pytest.mark.parametrize("layer", [0, 1])
def test_each_layer_writes_only_its_own_pages(layer):
    """A write through layer l's view lands in pool[:, l] and leaves every other layer's pages alone."""
    pool = PagedKVCache.zeros(2, num_pages=4, page_size=PAGE_SIZE, kv_heads=2, head_dim=8, dtype=jnp.float32)
    metadata = PagedAttentionMetadata(slot_mapping=jnp.array([PAGE_SIZE, PAGE_SIZE + 1, -1], jnp.int32),
                                      token_seq=jnp.zeros(3, jnp.int32), seq_lens=jnp.array([2], jnp.int32),
                                      block_tables=jnp.array([[1, 0]], jnp.int32))
    q = jnp.ones((1, 3, 2, 8))
    kv = jnp.full((1, 3, 2, 8), 7.0)
    _, cache = pool.with_metadata(metadata).update_and_attend(jnp.int32(layer), q, kv, kv, jnp.array([[0, 1, 0]]),
                                                              scale=1.0)
    written = cache.k_pages[:, layer, 1, :2]  # f[kv_heads, 2, head_dim]: page 1, slots 0 and 1
    assert bool(jnp.all(written == 7.0))
    assert float(jnp.abs(cache.k_pages).sum()) == float(jnp.abs(written).sum())  # the padding token wrote nothing
    assert float(jnp.abs(cache.v_pages[:, 1 - layer]).sum()) == 0.0


@pytest.mark.parametrize("slot", [5, -1])
def test_a_one_token_write_lands_in_its_slot_or_nowhere(slot):
    """The one-token write (padded with a dropped slot so that XLA keeps it a scatter) against numpy."""
    pages = jnp.arange(2 * 3 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 4, 2)  # f[kv_heads, pages, page_size, dim]
    new = jnp.full((1, 2, 2), -7.0)  # f[T=1, kv_heads, head_dim]
    expected = np.array(pages).reshape(2, 12, 2)
    if slot >= 0:
        expected[:, slot] = -7.0
    written = jax.jit(write_slots)(pages, new, jnp.array([slot], jnp.int32))
    np.testing.assert_array_equal(np.array(written).reshape(2, 12, 2), expected)
