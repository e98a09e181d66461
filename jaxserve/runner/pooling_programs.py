"""`PoolingPrograms`: a pooling engine's step programs (runner/pooling_step.py), in place of `StepPrograms`.

One program per plain bucket shape (the decode and mixed families of runner/buckets.py; no penalty, scoring or
draft variants, and no samplers: a pooling step samples nothing), all lowered against abstract weights and pool and
compiled at start-up like the generating engine's, after which the CompileGuard forbids compiling. It answers what
start-up asks of `StepPrograms` (compile_all, stats, the workspace measures) under the same names.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig
from jaxserve.pooler_config import MEAN_POOLING
from jaxserve.runner.buckets import BucketSet, StepBucket
from jaxserve.runner.compile_guard import CompileGuard
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.pooling_step import PoolingArrays, pooling_arrays, run_packed_pooling
from jaxserve.runner.program_store import ProgramStore
from jaxserve.runner.compile_options import StepCompilerOptions
from jaxserve.runner.step_programs import (AbstractArguments, ProgramLowering, WarmupStats, temp_bytes,
                                           compile_lowerings)
from jaxserve.schedule import ScheduledSequence


class PoolingPrograms:
    """The compiled pooling program of every plain bucket and the transfer buffer layout each one reads."""

    def __init__(self, graphdef: nnx.GraphDef, arguments: AbstractArguments, config: EngineConfig,
                 buckets: BucketSet, step_options: StepCompilerOptions, guard: CompileGuard):
        self._arguments = arguments
        self._config = config
        self._buckets = buckets
        self._step_options = step_options  # XLA options of the step programs (runner/compile_options.py)
        self._guard = guard
        self._mean = config.pooler_config.pooling_type == MEAN_POOLING  # else LAST
        self._run = jax.jit(functools.partial(run_packed_pooling, graphdef), static_argnames=("layout", "mean"),
                            donate_argnames="pool", out_shardings=(arguments.replicated, arguments.pool_shardings))
        self._programs: dict[StepBucket, jax.stages.Compiled] = {}
        self._layouts: dict[StepBucket, PackedLayout] = {}
        self.stats: WarmupStats | None = None  # set by compile_all

    def bucket_list(self) -> list[StepBucket]:
        """Every shape a pooling step may take: the plain decode and mixed buckets."""
        return [bucket for bucket in self._buckets.all_buckets()
                if not (bucket.penalties or bucket.prompt_logits or bucket.drafts)]

    def prepare(self, chunks: Sequence[ScheduledSequence], num_tokens: int) -> tuple[StepBucket, PoolingArrays]:
        """The bucket of a batch of `chunks` (`num_tokens` tokens in all) and its padded host inputs."""
        bucket = self._buckets.select(num_tokens, len(chunks))
        return bucket, pooling_arrays(chunks, bucket, self._config.max_pages_per_seq, self._config.block_size)

    def step(self, bucket: StepBucket) -> jax.stages.Compiled:
        """The bucket's pooling program: (params, pool, packed) -> (f32[S, hidden], pool)."""
        return self._programs[bucket]

    def layout(self, bucket: StepBucket) -> PackedLayout:
        """The transfer buffer of the bucket's program."""
        if bucket not in self._layouts:
            self._layouts[bucket] = PackedLayout.of(pooling_arrays([], bucket, self._config.max_pages_per_seq,
                                                                   self._config.block_size))
        return self._layouts[bucket]

    def compile_all(self, num_pages: int, progress: bool = True, store: ProgramStore | None = None) -> None:
        """Compiles every bucket's program for a pool of `num_pages` pages (StepPrograms.compile_all's way; `store` is
        taken for the same signature, and none of these programs is kept there yet)."""
        self.stats = compile_lowerings(self.lowerings(num_pages), self._guard, self._keep, progress, store)

    def lowerings(self, num_pages: int) -> list[ProgramLowering]:
        """Every program `compile_all` compiles for a pool of `num_pages` pages, not yet lowered."""
        return [ProgramLowering(bucket, False, functools.partial(self._lower, bucket, num_pages),
                                self._step_options.of(bucket.num_tokens))
                for bucket in self.bucket_list()]

    @property
    def count(self) -> int:
        return len(self.bucket_list())

    def largest_workspace_bytes(self, num_pages: int = 2) -> int:
        """Temporary memory of the largest pooling step on one device (StepPrograms.largest_workspace_bytes)."""
        largest = self._buckets.select(self._config.max_num_batched_tokens, self._config.max_num_seqs)
        with self._guard.watch():
            return temp_bytes(self._lower(largest, num_pages).compile(
                compiler_options=self._step_options.of(largest.num_tokens) or None))

    def compiled_workspaces(self) -> dict[str, int]:
        """Temporary memory of every program compiled (on one device), by program."""
        return {f"pooling step {bucket}": temp_bytes(program) for bucket, program in self._programs.items()}

    def _keep(self, program: ProgramLowering, compiled: jax.stages.Compiled) -> None:
        self._programs[program.bucket] = compiled

    def _lower(self, bucket: StepBucket, num_pages: int) -> jax.stages.Lowered:
        arguments, layout = self._arguments, self.layout(bucket)
        packed = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=arguments.replicated)
        return self._run.lower(arguments.params, arguments.pool(num_pages), packed, layout=layout, mean=self._mean)
