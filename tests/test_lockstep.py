"""The lockstep message, in one process: what the leader packs for a step is what a follower unpacks, for every
bucket shape; a stop message ends the follower's loop. (Two real processes: tests/test_multihost.py.)"""

import jax
import numpy as np
import pytest

from jaxserve.runner.lockstep import Command, StepChannel
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import SamplingRow, ScheduledSequence, SchedulerOutput


def _step(runner, params: SamplingParams, prompt_logprobs: bool = False):
    """A two-row step (a prefill chunk and a decode token) prepared as the leader would."""
    rows = [SamplingRow(params, prompt_ids=(5, 6, 7, 8), output_ids=[], eos_token_ids=(2,), seed=3, step=0),
            SamplingRow(params, prompt_ids=(1, 2, 3, 4), output_ids=[11], eos_token_ids=(2,), seed=4, step=1)]
    chunks = (ScheduledSequence("a", (5, 6, 7), 0, (1,), samples=True, wants_prompt_logits=prompt_logprobs,
                                sampling=rows[0]),
              ScheduledSequence("b", (9,), 4, (2,), samples=True, wants_prompt_logits=False, sampling=rows[1]))
    return runner.inputs.prepare(SchedulerOutput(step=0, sequences=chunks, num_batched_tokens=4))


def _as_follower(channel: StepChannel, message: np.ndarray):
    """What `receive` gives a follower when the broadcast delivers `message`."""
    channel._broadcast = lambda tree: message
    return channel.receive()


@pytest.mark.parametrize("params, prompt_logprobs", [
    (SamplingParams(temperature=0), False),
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, logit_bias={3: 2.0}), False),
    (SamplingParams(temperature=0, prompt_logprobs=1), True),
])
def test_a_step_unpacks_to_the_arrays_the_leader_packed(tiny_llm, params, prompt_logprobs):
    runner = tiny_llm.engine.runner
    channel = StepChannel(runner.buckets.all_buckets(), runner.inputs.padding_arrays)
    bucket, arrays = _step(runner, params, prompt_logprobs)
    message = channel._message(Command.STEP, channel._index[bucket], jax.tree.leaves(arrays))
    assert message.shape == (channel._width,) and message.dtype == np.uint8  # one shape for every bucket

    received_bucket, received = _as_follower(channel, message)
    assert received_bucket == bucket
    assert jax.tree.structure(received) == jax.tree.structure(arrays)
    for sent, got in zip(jax.tree.leaves(arrays), jax.tree.leaves(received)):
        assert got.dtype == sent.dtype and np.array_equal(got, sent)


def test_a_stop_message_ends_the_follow_loop(tiny_llm):
    runner = tiny_llm.engine.runner
    channel = StepChannel(runner.buckets.all_buckets(), runner.inputs.padding_arrays)
    assert _as_follower(channel, channel._message(Command.STOP, 0, [])) is None
