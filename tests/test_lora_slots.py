"""LoRA slots on the device: the batched delta of mixed adapters equals each token's own adapter's delta."""

import jax
import numpy as np
import pytest

from jaxserve.checkpoint.lora_config import PROJECTIONS
from jaxserve.checkpoint.lora_adapter import projection_shape
from jaxserve.checkpoint.lora_slots import SlotWeights
from jaxserve.model.lora import empty_lora_stack, lora_delta, lora_delta_by_gather, with_slot
from tests.test_lora_adapter import BASE, _load, _write_adapter

MAX_RANK = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters of different ranks, projections and layers (rsLoRA on one)."""
    work = tmp_path_factory.mktemp("lora_slots")
    specs = [dict(rank=4, projections=("q_proj", "v_proj")),
             dict(rank=8, projections=PROJECTIONS, seed=1, lora_alpha=16),
             dict(rank=2, projections=("o_proj", "down_proj"), layers=[1], seed=2, use_rslora=True,
                  layers_to_transform=[1])]
    loaded = []
    for index, spec in enumerate(specs):
        _write_adapter(work / f"a{index}", **{"projections": spec.pop("projections"), **spec})
        loaded.append(_load(work / f"a{index}"))
    return loaded


def empty_stack(num_slots: int):
    shapes = {p: projection_shape(BASE, p) for p in PROJECTIONS}
    return empty_lora_stack(shapes, BASE.num_hidden_layers, num_slots, MAX_RANK, np.float32)


def written(stack, slot: int, adapter):
    weights = SlotWeights.of(adapter, BASE, MAX_RANK)
    return jax.jit(with_slot)(stack, np.int32(slot), weights.a, weights.b)


@pytest.fixture(scope="module")
def slots(adapters):
    stack = empty_stack(num_slots=len(adapters) + 2)  # one slot left empty
    for slot, adapter in enumerate(adapters, start=1):
        stack = written(stack, slot, adapter)
    return jax.tree.map(np.asarray, stack)


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_mixed_slots_in_one_batch_give_each_tokens_own_adapter_delta(adapters, slots, projection):
    rng = np.random.default_rng(3)
    layer = 1
    a, b = slots.a[projection][layer], slots.b[projection][layer]  # f32[slots, r, in], f32[slots, out, r]
    token_slots = np.array([0, 1, 2, 3, 4, 2, 1, 0, 3], np.int32)  # base model, each adapter, an empty slot
    x = rng.normal(size=(len(token_slots), a.shape[2])).astype(np.float32)
    batched = np.asarray(jax.jit(lora_delta)(x, a, b, token_slots))
    gathered = np.asarray(jax.jit(lora_delta_by_gather)(x, a, b, token_slots))
    for t, slot in enumerate(token_slots):
        adapter = adapters[slot - 1] if 1 <= slot <= len(adapters) else None
        own = adapter.delta(projection, layer) if adapter is not None and projection in adapter.weights else None
        want = x[t] @ own.T if own is not None else np.zeros(b.shape[1], np.float32)
        np.testing.assert_allclose(batched[t], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gathered[t], want, rtol=1e-5, atol=1e-5)


def test_a_rewritten_slot_holds_only_its_new_adapter_and_other_slots_stay(adapters):
    stack = written(empty_stack(num_slots=3), 2, adapters[2])
    stack = written(stack, 1, adapters[1])  # every projection
    stack = written(stack, 1, adapters[0])  # q and v only: the others must be cleared
    arrays = jax.tree.map(np.asarray, stack)
    assert not arrays.a["o_proj"][:, 1].any() and not arrays.b["down_proj"][:, 1].any()
    np.testing.assert_allclose(arrays.b["q_proj"][0, 1, :, :4] @ arrays.a["q_proj"][0, 1, :4],
                               adapters[0].delta("q_proj", 0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(arrays.b["o_proj"][1, 2, :, :2] @ arrays.a["o_proj"][1, 2, :2],
                               adapters[2].delta("o_proj", 1), rtol=1e-5, atol=1e-7)
    assert not any(arrays.a[p][:, 0].any() or arrays.b[p][:, 0].any() for p in PROJECTIONS)
    cleared = jax.tree.map(np.asarray, written(stack, 1, None))
    assert not any(cleared.a[p][:, 1].any() or cleared.b[p][:, 1].any() for p in PROJECTIONS)
