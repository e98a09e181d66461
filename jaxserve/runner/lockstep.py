"""Lockstep over processes: the leader's step inputs reach every process, which then all run the same program.

A multi-process mesh runs SPMD programs that every process must launch, in the same order, with the same inputs.
Only the leader schedules, so each step it broadcasts what it decided, in two collectives over JAX
(`broadcast_one_to_all`): a fixed-size header i32[2] (what to do, and which bucket), then the step's padded host
arrays, whose shapes the bucket fixes, so every broadcast has a static shape and each is compiled once, at warm-up.
Followers receive, run the bucket's program, and never read results back. Async scheduling stays on: the leader
broadcasts and launches from one thread in step order, and a step's pending tokens come from the previous step's
device output, which every process holds alike. Each broadcast does wait for its data on the host, so the leader's
host work overlaps the device less than on one process.

A collective that fails (a peer died) ends this process through `abort_group`, with one clear log line.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all
from jax.sharding import Mesh

from jaxserve.errors import ConfigError
from jaxserve.parallel.process_group import LEADER, abort_group
from jaxserve.runner.buckets import StepBucket
from jaxserve.runner.step import StepArrays


class Command(enum.IntEnum):
    """What the leader tells the followers to do next."""

    STEP = 1  # run the bucket's program on the arrays that follow
    STOP = 2  # the leader is shutting down: leave the follow loop


class StepChannel:
    """The leader's sending side and the followers' receiving side of the per-step broadcast."""

    def __init__(self, buckets: Sequence[StepBucket], padding_arrays: Callable[[StepBucket], StepArrays]):
        self._buckets = list(buckets)  # every compiled bucket, in the same order on every process
        self._index = {bucket: i for i, bucket in enumerate(self._buckets)}  # bucket -> its number in the header
        self._padding_arrays = padding_arrays  # bucket -> inputs of its shapes (what followers broadcast into)
        self.is_leader = jax.process_index() == LEADER

    def warm_up(self) -> None:
        """Compiles the broadcast of the header and of every bucket's arrays, on every process in the same order."""
        self._broadcast(np.zeros(2, np.int32))
        for bucket in self._buckets:
            self._broadcast(self._padding_arrays(bucket))

    def send_step(self, bucket: StepBucket, arrays: StepArrays) -> None:
        """Leader: the followers run `bucket` on `arrays` next."""
        self._broadcast(np.array([Command.STEP, self._index[bucket]], np.int32))
        self._broadcast(arrays)

    def send_stop(self) -> None:
        """Leader: the followers leave their loop."""
        self._broadcast(np.array([Command.STOP, 0], np.int32))

    def receive(self) -> tuple[StepBucket, StepArrays] | None:
        """Follower: blocks for the leader's next step; None when the leader stops."""
        command, index = self._broadcast(np.zeros(2, np.int32))
        if command == Command.STOP:
            return None
        bucket = self._buckets[int(index)]
        return bucket, self._broadcast(self._padding_arrays(bucket))

    def _broadcast(self, tree):
        try:
            return broadcast_one_to_all(tree, is_source=self.is_leader)
        except Exception as e:  # a peer is gone: this process can never rejoin the group's lockstep
            abort_group("a process of the group failed during a step broadcast", e)


def spans_processes(mesh: Mesh) -> bool:
    """True when the mesh holds devices of more than one process; ConfigError when it leaves a process out.

    Every process must hold part of the mesh: lockstep has each of them launch every step.
    """
    processes = {device.process_index for device in mesh.devices.flat}
    if jax.process_count() > 1 and len(processes) < jax.process_count():
        raise ConfigError(f"the tensor-parallel mesh covers {len(processes)} of {jax.process_count()} processes; "
                          f"with several processes tensor_parallel_size must span them all "
                          f"({jax.device_count()} devices in all)")
    return len(processes) > 1
