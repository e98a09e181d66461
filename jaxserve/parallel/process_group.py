"""Several processes (hosts) as one JAX program: `jax.distributed.initialize`, and how the group ends when one dies.

After initialisation `jax.devices()` lists the devices of every process, so the tensor-parallel mesh spans hosts;
the processes then run the same compiled steps in lockstep (jaxserve/runner/lockstep.py). JAX is the transport:
the coordination service (hosted by process 0) checks heartbeats, collectives go over the backend's own links
(NCCL on GPUs, gloo between CPU processes).

A peer dying ends the others within a bounded time, one of two ways (both observed on CPU with SIGKILL):
  - a process blocked in a collective with the dead peer gets an error from it ("Gloo all-reduce failed ...
    Connection reset by peer"), which `abort_group` turns into one log line and exit code EXIT_PEER_LOST;
  - a process with nothing in flight (an idle server) hears from the coordination service once the peer has
    missed heartbeats for `heartbeat_timeout_s`: JAX logs "Terminating process because the JAX distributed service
    detected fatal errors. This most likely indicates that another task died" and aborts the process (SIGABRT).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.errors import ConfigError

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3  # exit code of a process that ends because another process of its group failed
LEADER = 0  # the process that owns the HTTP server and the scheduler


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run."""

    coordinator: str  # HOST:PORT of process 0's coordination service, reachable from every process
    num_processes: int  # processes in the group (hosts, or one process per host's set of devices)
    process_id: int  # this process's rank, 0 .. num_processes - 1; 0 is the leader
    heartbeat_timeout_s: int = 10  # a peer silent this long is declared dead and the group ends
    initialization_timeout_s: int = 300  # how long process 0 waits for every peer to join
    shutdown_timeout_s: int = 30  # how long a process leaving normally waits for the others at the exit barrier

    def __post_init__(self):
        if self.num_processes < 1:
            raise ConfigError(f"num_processes must be at least 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if ":" not in self.coordinator:
            raise ConfigError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == LEADER


def initialize_process_group(group: ProcessGroup) -> None:
    """Joins the group; must run before anything else touches JAX. Blocks until every process has joined."""
    log.info("joining process group at %s as process %d of %d (a peer silent for %d s ends the group)",
             group.coordinator, group.process_id, group.num_processes, group.heartbeat_timeout_s)
    jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.num_processes,
                               process_id=group.process_id, initialization_timeout=group.initialization_timeout_s,
                               heartbeat_timeout_seconds=group.heartbeat_timeout_s,
                               shutdown_timeout_seconds=group.shutdown_timeout_s)
    log.info("process group ready: %d devices in all, %d here", jax.device_count(), jax.local_device_count())


def smallest_across_processes(value: int) -> int:
    """The smallest of every process's `value` (itself on one process): a size all of them can hold, such as pool
    pages counted from each host's own free memory, which every process must agree on to compile the same programs.
    """
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.process_allgather(np.array([value], np.int64)).min())


def abort_group(reason: str, error: BaseException | None = None) -> None:
    """Ends this process at once because the group can no longer run in lockstep.

    `os._exit`, not an exception: the other processes are blocked in (or about to enter) a collective that this one
    would never join, and Python's normal shutdown would itself wait on the distributed runtime.
    """
    log.critical("%s%s; ending process %d of the group (exit code %d)", reason, f": {error!r}" if error else "",
                 jax.process_index(), EXIT_PEER_LOST)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)
