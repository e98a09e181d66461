"""PackedLayout (a step's inputs in one transfer) against the reference, the same arrays transferred one by one; and
the engine's per-phase host times (StepPhaseTimes), which show what such transfers cost."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.runner.packed_inputs import PackedLayout


def _random_like(array: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Values that exercise every byte: negative ints, high unsigned bits, fractional floats, both booleans."""
    if array.dtype == np.bool_:
        return rng.random(array.shape) < 0.5
    if np.issubdtype(array.dtype, np.floating):
        return rng.normal(0, 1e3, array.shape).astype(array.dtype)
    info = np.iinfo(array.dtype)
    return rng.integers(info.min, info.max, array.shape, dtype=array.dtype, endpoint=True)


def test_every_buckets_inputs_arrive_as_the_one_by_one_transfer_gives_them(tiny_llm):
    runner = tiny_llm.engine.runner
    rng = np.random.default_rng(0)
    buckets = runner.buckets.all_buckets()
    assert {np.dtype(leaf.dtype).name for bucket in buckets for leaf in PackedLayout.of(
        runner.inputs.padding_arrays(bucket)).leaves} >= {"bool", "int32", "uint32", "float32"}
    for bucket in buckets:
        host = jax.tree.map(lambda x: _random_like(x, rng), runner.inputs.padding_arrays(bucket))
        layout = PackedLayout.of(host)
        packed = layout.pack(host)
        assert packed.dtype == np.int32 and packed.shape == (layout.size,)
        unpacked = jax.jit(layout.unpack)(jax.device_put(packed))
        expected = jax.device_put(host)  # the reference: one transfer per array
        assert jax.tree.structure(unpacked) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(unpacked), jax.tree.leaves(expected)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_inputs_of_another_shape_or_dtype_are_refused_before_any_transfer():
    layout = PackedLayout.of({"ids": np.zeros(4, np.int32), "scale": np.zeros((2, 3), np.float32)})
    assert layout.size == 4 + 6
    with pytest.raises(ValueError, match="int32\\[4\\].*int32\\[5\\]|int32\\[5\\].*int32\\[4\\]"):
        layout.pack({"ids": np.zeros(5, np.int32), "scale": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="float64"):
        layout.pack({"ids": np.zeros(4, np.int32), "scale": np.zeros((2, 3), np.float64)})
    with pytest.raises(ValueError, match="int64"):
        PackedLayout.of({"ids": np.zeros(4, np.int64)})
    with pytest.raises(ValueError, match="layout"):
        layout.pack({"ids": np.zeros(4, np.int32)})


def test_step_phase_times_count_every_step_and_stay_within_its_wall_time(tiny_llm):
    engine = tiny_llm.engine
    before = dataclasses.replace(engine.phase_times)
    started = time.perf_counter()
    engine.add_request("phases", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall_s = time.perf_counter() - started
    spent = engine.phase_times.since(before)
    phases = [spent.schedule_s, spent.dispatch_s, spent.wait_s, spent.outputs_s]
    assert spent.steps == steps and steps >= 6
    assert all(seconds > 0 for seconds in phases) and sum(phases) <= wall_s
    assert spent.per_step_ms()["dispatch"] == pytest.approx(1e3 * spent.dispatch_s / steps)
