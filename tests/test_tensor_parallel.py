"""Tensor parallelism on 8 simulated CPU devices: TP 1, 2, 4 and 8 agree token for token, weights are sharded as
the rules say, each device holds its share of the bytes, and the collectives are Megatron's.

The checks run in one subprocess (tests/tensor_parallel_probe.py), since the device count must be set before JAX
starts. The engines use the XLA attention backend (the CPU's default), and at TP 2 and 8 also the Pallas kernel
through Pallas' interpreter; both run inside shard_map over the KV heads.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PROBE = "tests.tensor_parallel_probe"  # run as a module from ROOT, so that it can import the tests' helpers


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("tensor_parallel")
    done = subprocess.run([sys.executable, "-m", PROBE, str(work)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(tp): engine for tp, engine in result.pop("engines").items()} | result


pytestmark = pytest.mark.slow


def test_every_tensor_parallel_size_gives_the_single_device_greedy_tokens(report):
    reference = report[1]["tokens"]
    assert all(len(tokens) > 0 for tokens in reference)
    for tp in (2, 4, 8):
        assert report[tp]["tokens"] == reference, f"TP={tp}"


def test_constrained_draws_match_their_regex_and_the_single_device_ones(report):
    import re

    reference = report[1]["constrained"]
    assert all(re.fullmatch(report["constraint"], text) for text in reference), reference
    for tp in (2, 4, 8):
        assert report[tp]["constrained"] == reference, f"TP={tp}"


def test_the_pallas_kernel_inside_shard_map_gives_the_same_tokens(report):
    for tp, engine in report["pallas_engines"].items():
        assert engine["tokens"] == report[1]["tokens"], f"TP={tp}"
        assert engine["compiles_after_warmup"] == 0, f"TP={tp}"


def test_quantized_weights_and_their_scales_shard_like_the_weights_they_stand_for(report):
    single, split = report["int8_engines"]["1"], report["int8_engines"]["4"]
    assert split["tokens"] == single["tokens"] and all(len(tokens) > 0 for tokens in single["tokens"])
    assert split["wrong_shardings"] == [] and split["device_bytes"] == [split["expected_device_bytes"]]
    assert split["collectives"] == report[4]["collectives"] and split["compiles_after_warmup"] == 0


def test_a_float8_kv_pool_splits_over_kv_heads_and_decodes_alike(report):
    single, split = report["fp8_kv_engines"]["1"], report["fp8_kv_engines"]["4"]
    assert single["pool_dtype"] == split["pool_dtype"] == "float8_e4m3fn"
    assert split["tokens"] == single["tokens"] and all(len(tokens) > 0 for tokens in single["tokens"])
    assert split["pool_shard_shape"][0] == 1 and split["compiles_after_warmup"] == 0
    assert split["collectives"] == report[4]["collectives"]


def test_drafts_verified_under_tensor_parallelism_change_no_token(report):
    speculative = report["speculative_engines"]["4"]
    assert speculative["tokens"] == report[1]["tokens"]
    assert speculative["num_draft_tokens"] > 0 and speculative["compiles_after_warmup"] == 0


def test_a_draft_model_splits_over_the_same_devices_and_changes_no_token(report):
    drafted = report["draft_model_engines"]["4"]
    assert drafted["tokens"] == report[1]["tokens"]
    assert drafted["num_draft_tokens"] > 0 and drafted["compiles_after_warmup"] == 0
    assert drafted["draft_pool_shard_shape"][0] == 1  # one (repeated) KV head per device


def test_fewer_kv_heads_than_devices_are_repeated_at_load_time(report):
    # The model stores 2 KV heads: TP 4 and 8 run with one (repeated) KV head per device.
    assert [report[tp]["kv_heads"] for tp in (1, 2, 4, 8)] == [2, 2, 4, 8]
    assert [report[tp]["pool_shard_shape"][0] for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]


def test_each_weight_is_sharded_as_the_rules_say(report):
    for tp in (1, 2, 4, 8):
        assert report[tp]["wrong_shardings"] == [], f"TP={tp}"


def test_each_device_holds_its_share_of_the_weights(report):
    # Every device holds 1/N of each split tensor plus the whole of each replicated one (the norms), the same bytes.
    for tp in (1, 2, 4, 8):
        assert report[tp]["device_bytes"] == [report[tp]["expected_device_bytes"]], f"TP={tp}"


def test_loading_reads_each_distinct_device_slice_once(report):
    assert report["shard_reads"]["reads"] == report["shard_reads"]["distinct_slices"]


def test_no_compile_after_warm_up(report):
    for tp in (1, 2, 4, 8):
        assert report[tp]["compiles_after_warmup"] == 0, f"TP={tp}"


def test_collectives_are_two_all_reduces_per_layer_and_one_logits_gather(report):
    assert report[1]["collectives"] == {}
    for tp in (2, 4, 8):
        # Two in the scanned layer's body (after o_proj and down_proj; the body runs once per layer) plus one for
        # the vocabulary-split embedding lookup.
        assert report[tp]["collectives"] == {"all-reduce": 2 + 1, "all-gather": 1}, f"TP={tp}"
        # The sampled rows' logits f32[S, vocab], never the f[vocab, hidden] weight.
        assert [shape.split("{")[0] for shape in report[tp]["all_gather_shapes"]] == ["f32[2,512]"], f"TP={tp}"


def test_orbax_restore_places_the_same_shards_as_safetensors(report):
    assert report["orbax_matches_safetensors"]


def test_builtin_model_drawn_sharded_equals_the_single_device_draw(report):
    assert report["builtin_matches_single_device"]


def test_sizes_the_model_or_the_machine_cannot_take_are_config_errors():
    from jaxserve.model.config import LlamaConfig
    from jaxserve.parallel import plan_tensor_parallel
    from tests.hf_models import tiny_hf_config

    cfg = LlamaConfig.from_hf_dict(tiny_hf_config())  # 4 query heads, 2 KV heads; this process sees one device
    with pytest.raises(ConfigError, match="needs that many devices"):
        plan_tensor_parallel(cfg, 2)
    with pytest.raises(ConfigError, match="divide the model's 4 attention heads"):
        plan_tensor_parallel(cfg, 3)
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        plan_tensor_parallel(LlamaConfig.from_hf_dict(tiny_hf_config(num_attention_heads=12, num_key_value_heads=3,
                                                                     head_dim=8, hidden_size=96)), 4)
    with pytest.raises(ConfigError, match="positive"):
        plan_tensor_parallel(cfg, 0)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("tp", [2, 8])
def test_the_kernel_under_shard_map_lowers_for_cuda_over_a_mesh_of_h100s(tp):
    """Llama-3-8B's attention (32 query heads, 8 KV heads of 128, bfloat16) through the cache's shard_map over an
    abstract mesh of H100s: the real Triton lowering runs on this CPU, one kernel per device program."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.model.paged_kv_cache import PALLAS_BACKEND, PagedAttentionMetadata, PagedKVCache
    from jaxserve.parallel import KV_POOL_SPEC, TP_AXIS
    from tests.cuda_lowering import H100, TRITON_TARGET, triton_calls

    mesh = AbstractMesh((tp,), (TP_AXIS,), axis_types=(AxisType.Auto,), abstract_device=H100)
    pool_sharding = NamedSharding(mesh, KV_POOL_SPEC)
    tokens, seqs, heads, kv_heads, head_dim = 64, 8, 32, 8, 128

    def write_and_attend(q, k, v, k_pages, v_pages, metadata, positions):
        cache = PagedKVCache(k_pages, v_pages, metadata, PALLAS_BACKEND, pool_sharding)
        out, cache = cache.update_and_attend(jnp.int32(1), q[None], k[None], v[None], positions[None],
                                             head_dim ** -0.5)
        return out, cache.k_pages, cache.v_pages

    whole, by_head = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, TP_AXIS, None))
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=whole)  # i32[T]
    metadata = PagedAttentionMetadata(slot_mapping=ids, token_seq=ids,
                                      block_tables=jax.ShapeDtypeStruct((seqs, 512), jnp.int32, sharding=whole),
                                      seq_lens=jax.ShapeDtypeStruct((seqs,), jnp.int32, sharding=whole))
    q = jax.ShapeDtypeStruct((tokens, heads, head_dim), jnp.bfloat16, sharding=by_head)  # f[T, heads, head_dim]
    kv = jax.ShapeDtypeStruct((tokens, kv_heads, head_dim), jnp.bfloat16, sharding=by_head)  # f[T, kv_heads, hd]
    # f[kv_heads, layers, pages, page_size, head_dim]
    pool = jax.ShapeDtypeStruct((kv_heads, 2, 4096, 16, head_dim), jnp.bfloat16, sharding=pool_sharding)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(write_and_attend), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_TARGET)],
        )(q, kv, kv, pool, pool, metadata, ids)
    assert exported.nr_devices == tp
    assert triton_calls(exported) == 1
    # Inside shard_map each device's program holds only its KV heads of the pool, and the kernel reads all of its
    # layers as one page space (2 layers x 4096 pages; a free reshape), never a copied slice of one layer.
    assert f"tensor<{kv_heads // tp}x2x4096x16x128xbf16>" in exported.mlir_module()
    assert f"tensor<{kv_heads // tp}x8192x16x128xbf16>" in exported.mlir_module()
    assert f"tensor<{kv_heads // tp}x4096x16x128xbf16>" not in exported.mlir_module()
