"""`StepPrograms`: every program a runner's steps run, lowered against abstract arguments and compiled ahead of time.

Each bucket has one program, or a plain bucket (runner/step.py) a forward program and the sampler of its row count.
They are lowered against the shapes, dtypes and shardings of the weights, the pool, the LoRA slots and the packed
inputs alone, so compiling needs neither the weights nor the pool and can run while the weights load; the runner
(runner/model_runner.py) calls what is compiled here with the real arrays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.model.paged_kv_cache import PagedKVCache
from jaxserve.model.quantization import XLA_GEMM
from jaxserve.runner.buckets import BucketSet, StepBucket
from jaxserve.runner.compile_guard import CompileGuard, counting_compiles
from jaxserve.runner.compile_options import StepCompilerOptions
from jaxserve.runner.packed_inputs import PackedLayout
from jaxserve.runner.program_keys import ProgramCall, UnstableKeyError, program_key
from jaxserve.runner.program_store import ProgramStore, compiling_afresh
from jaxserve.runner.step import (LogitsShardings, StepArrays, run_packed_forward, run_packed_sampling,
                                  run_packed_step)
from jaxserve.runner.step_inputs import StepInputBuilder


@dataclasses.dataclass(frozen=True)
class ProgramLowering:
    """One program `StepPrograms.compile_all` compiles, before it is lowered: which one, and how to lower it."""

    bucket: StepBucket  # the step shape it serves; a sampler's is the decode bucket of its row count
    sampler: bool  # the plain steps' sampler of bucket.num_seqs rows, rather than the bucket's step program
    lower: Callable[[], jax.stages.Lowered]  # traces and lowers it; needs neither the weights nor the pool
    compiler_options: dict  # XLA options it compiles with (runner/compile_options.py); {}: XLA's defaults
    # Its jitted function and abstract arguments, whose signature keys it in a ProgramStore (nothing traced);
    # None: it is never stored, always compiled
    call: Callable[[], ProgramCall] | None = None
    truncation: bool = True  # a sampler: with top-k / top-p / min-p; False: the variant for steps where no row truncates

    @property
    def stored_name(self) -> str:
        """Its name in a program store: "step-T512-S64-penalties", "sampler-T8-S8", "sampler-T8-S8-untruncated"."""
        bucket = self.bucket
        flags = [flag for flag in ("prompt_logits", "penalties", "drafts") if getattr(bucket, flag)]
        flags += [] if self.truncation else ["untruncated"]
        return "-".join(["sampler" if self.sampler else "step", f"T{bucket.num_tokens}", f"S{bucket.num_seqs}", *flags])


@dataclasses.dataclass(frozen=True)
class ProgramSources:
    """Where each program of a warm-up came from."""

    store: int = 0  # loaded whole from the program store (runner/program_store.py): not traced, lowered or compiled
    cache: int = 0  # lowered, then handed back by JAX's persistent compilation cache (or its in-memory one)
    compiled: int = 0  # lowered and compiled by XLA

    def text(self) -> str:
        """"40 from the store, 10 from the compilation cache, 5 compiled" (the counts that are not 0)."""
        parts = [(self.store, "from the store"), (self.cache, "from the compilation cache"),
                 (self.compiled, "compiled")]
        return ", ".join(f"{count} {what}" for count, what in parts if count) or "none"


@dataclasses.dataclass(frozen=True)
class WarmupStats:
    """What compiling the step programs cost at start-up."""

    programs: int  # step and sampling programs made ready: loaded from the store, or compiled (or found cached)
    lower_seconds: float  # tracing and lowering all of them, in this thread
    compile_seconds: float  # wall time from the first compile started to the last one done (they run in parallel)
    sources: ProgramSources = ProgramSources()  # where they came from
    store_seconds: float = 0.0  # reading programs from the store, in this thread
    stored: int = 0  # of those compiled, the ones written to the store

    @property
    def all_in_store(self) -> bool:
        """Every program is now in the store: loaded from it, or compiled and written to it."""
        return self.sources.store + self.stored == self.programs


@dataclasses.dataclass(frozen=True)
class AbstractArguments:
    """What the step programs are lowered against: shapes, dtypes and shardings, nothing placed."""

    params: nnx.State  # the weights (jax.ShapeDtypeStruct leaves)
    pool: Callable[[int], PagedKVCache]  # the KV pool of so many pages (jax.ShapeDtypeStruct leaves)
    pool_shardings: PagedKVCache  # each pool array's sharding, what every step returns the pool with
    last_tokens: jax.ShapeDtypeStruct  # i32[max_rows]: the previous step's sampled tokens
    lora: object | None  # the LoRA slots' stack (jax.ShapeDtypeStruct leaves); None: no adapters served
    replicated: NamedSharding  # every step input and output other than weights, pool and LoRA slots
    logits: LogitsShardings  # the logits as computed (split over the vocabulary under TP) and as sampled
    mask_width: int  # W: 32-bit words of a row's grammar token mask


class StepPrograms:
    """The compiled programs of every bucket, and the transfer buffer layout each one reads its inputs from."""

    def __init__(self, graphdef: nnx.GraphDef, arguments: AbstractArguments, config: EngineConfig,
                 vocab_size: int, buckets: BucketSet, inputs: StepInputBuilder, step_options: StepCompilerOptions,
                 guard: CompileGuard, stacked_gemm: str = XLA_GEMM, lowering_mesh=None):
        self._arguments = arguments
        self._config = config
        self._vocab_size = vocab_size
        self._buckets = buckets
        self._inputs = inputs  # gives each bucket's padding inputs: the shapes its transfer buffer packs
        self._step_options = step_options  # each step program's XLA options (samplers keep the defaults)
        self._guard = guard
        # How the step programs read quantized weights (model/quantization.py): a static argument of each, so that
        # it keys them in a program store
        self._stacked_gemm = stacked_gemm
        # The abstract mesh of devices that are described, not present (ProgramCall.abstract_mesh); None: at hand
        self._lowering_mesh = lowering_mesh
        self._step = jax.jit(functools.partial(run_packed_step, graphdef, logits_shardings=arguments.logits),
                             static_argnames=("layout", "num_top_logprobs", "stacked_gemm"), donate_argnames="pool",
                             out_shardings=(arguments.replicated, arguments.pool_shardings))
        self._forward = jax.jit(functools.partial(run_packed_forward, graphdef, logits_shardings=arguments.logits),
                                static_argnames=("layout", "sampling_words", "stacked_gemm"), donate_argnames="pool",
                                out_shardings=(arguments.replicated, arguments.pool_shardings))
        self._sampling = jax.jit(run_packed_sampling,
                                 static_argnames=("layout", "num_top_logprobs", "max_rows", "truncation"),
                                 out_shardings=arguments.replicated)
        # Per bucket: its one program, or a plain bucket's forward program
        self._programs: dict[StepBucket, jax.stages.Compiled] = {}
        # (row count, truncation) -> plain steps' sampler: with top-k / top-p / min-p, or without (no sort)
        self._samplers: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._layouts: dict[StepBucket, PackedLayout] = {}  # each bucket's inputs in its one transfer buffer
        self._sampling_layouts: dict[int, PackedLayout] = {}  # row count -> its sampling tensors' transfer buffer
        self.stats: WarmupStats | None = None  # set by compile_all

    def step(self, bucket: StepBucket) -> jax.stages.Compiled:
        """The bucket's one program, or a plain bucket's forward program."""
        return self._programs[bucket]

    def sampler(self, num_rows: int, truncation: bool = True) -> jax.stages.Compiled:
        """The sampler of plain steps of `num_rows` rows; `truncation` False: the one for steps where no row
        truncates (sampler.needs_truncation), which does not sort."""
        return self._samplers[num_rows, truncation]

    def of_bucket(self, bucket: StepBucket) -> list[jax.stages.Compiled]:
        """The programs a step of the bucket runs, in order: its one program, or its forward program and sampler."""
        return [self.step(bucket), self.sampler(bucket.num_seqs)] if splits(bucket) else [self.step(bucket)]

    def reference_step(self, *args, **kwargs):
        """Any step as one program (run_packed_step), jitted on the call: the reference that a plain bucket's two
        programs are checked against."""
        return self._step(*args, **kwargs)

    def compile_all(self, num_pages: int, progress: bool = True, store: ProgramStore | None = None) -> None:
        """Compiles every program for a pool of `num_pages` pages, or loads it from `store` where it is kept there.

        Each program is lowered here, then compiled on a thread pool (XLA compiles release the GIL), one per core,
        while the next ones lower. Two bars count programs lowered and compiled, each to its total.
        """
        self.stats = compile_lowerings(self.lowerings(num_pages), self._guard, self._keep, progress, store)

    def lowerings(self, num_pages: int) -> list[ProgramLowering]:
        """Every program `compile_all` compiles for a pool of `num_pages` pages, not yet lowered: each bucket's
        program (a plain bucket's forward), then two samplers per row count of the plain buckets (with and without
        truncation)."""
        return ([ProgramLowering(bucket, False, functools.partial(self._lower, bucket, num_pages),
                                 self._step_options.of(bucket.num_tokens),
                                 functools.partial(self._call, bucket, num_pages))
                 for bucket in self._buckets.all_buckets()]
                + [ProgramLowering(StepBucket(rows, rows), True, functools.partial(self._lower_sampling, rows, truncation),
                                   {}, functools.partial(self._sampling_call, rows, truncation), truncation)
                   for rows in self._sampling_row_counts() for truncation in (True, False)])

    @property
    def count(self) -> int:
        """Programs `compile_all` compiles: one per bucket and two samplers per row count of the plain buckets."""
        return len(self._buckets.all_buckets()) + 2 * len(self._sampling_row_counts())

    def largest_workspace_bytes(self, num_pages: int = 2) -> int:
        """Temporary memory of the largest step (all tokens, all rows, full sampler, prompt scores) on one device,
        from XLA's analysis of the (per-device, under tensor parallelism) program.

        Compiled against a pool of `num_pages` pages, by default two: the workspace does not grow with the pool
        (layers index the whole pool; no layer's pages are ever copied), so it is measured before the real pool
        exists, and the pool is sized to what is left; `compiled_workspaces` checks that after warm-up.
        """
        tokens, rows = self._config.max_num_batched_tokens, self._config.max_num_seqs
        # The scoring bucket runs the full sampler (penalties) and adds the prompt scores' logits tiles: the most, up
        # to XLA's buffer assignment, which the check after warm-up allows for.
        largest = [self._buckets.select(tokens, rows, prompt_logits=True)]
        if self._buckets.speculative:  # its sampler works on K + 1 logits rows per sequence
            largest.append(self._buckets.select(tokens, rows, drafts=True))
        return max(self.workspace_bytes(bucket, num_pages) for bucket in largest)

    def compiled_workspaces(self) -> dict[str, int]:
        """Temporary memory of every program compiled (on one device), by program: what each step needs beside
        weights and pool at the pool's real size, which the sizing's two-page measurement stands for."""
        programs = {**{f"step {bucket}": program for bucket, program in self._programs.items()},
                    **{f"sampler of {rows} rows" + ("" if truncation else " (untruncated)"): program
                       for (rows, truncation), program in self._samplers.items()}}
        return {name: temp_bytes(program) for name, program in programs.items()}

    def workspace_bytes(self, bucket: StepBucket, num_pages: int) -> int:
        """Temporary memory of the bucket's program (a plain bucket's forward) against a pool of `num_pages`."""
        with self._guard.watch():
            options = self._step_options.of(bucket.num_tokens)
            return temp_bytes(self._lower(bucket, num_pages).compile(compiler_options=options or None))

    def layout(self, bucket: StepBucket) -> PackedLayout:
        """The transfer buffer of the bucket's program, or of a plain bucket's two programs."""
        if bucket not in self._layouts:
            self._layouts[bucket] = PackedLayout.of(packed_tree(bucket, self._inputs.padding_arrays(bucket)))
        return self._layouts[bucket]

    def _keep(self, program: ProgramLowering, compiled: jax.stages.Compiled) -> None:
        if program.sampler:
            self._samplers[program.bucket.num_seqs, program.truncation] = compiled
        else:
            self._programs[program.bucket] = compiled

    def _lower(self, bucket: StepBucket, num_pages: int) -> jax.stages.Lowered:
        """The bucket's one program, or a plain bucket's forward program."""
        return self._call(bucket, num_pages).lower()

    def _call(self, bucket: StepBucket, num_pages: int) -> ProgramCall:
        """What the bucket's program (a plain bucket's forward) is lowered from."""
        arguments, layout = self._arguments, self.layout(bucket)
        packed = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=arguments.replicated)
        pool = arguments.pool(num_pages)
        if splits(bucket):
            return ProgramCall(self._forward, "run_packed_forward",
                               (arguments.params, pool, arguments.last_tokens, packed, arguments.lora),
                               dict(layout=layout, sampling_words=self._sampling_layout(bucket.num_seqs).size,
                                    stacked_gemm=self._stacked_gemm), self._lowering_mesh)
        return ProgramCall(self._step, "run_packed_step",
                           (arguments.params, pool, arguments.last_tokens, packed,
                            self._abstract_allowed(bucket.num_seqs), arguments.lora),
                           dict(layout=layout, num_top_logprobs=self._config.max_logprobs,
                                stacked_gemm=self._stacked_gemm), self._lowering_mesh)

    def _lower_sampling(self, num_rows: int, truncation: bool = True) -> jax.stages.Lowered:
        """The sampler of plain steps of `num_rows` rows, with or without truncation."""
        return self._sampling_call(num_rows, truncation).lower()

    def _sampling_call(self, num_rows: int, truncation: bool = True) -> ProgramCall:
        """What the sampler of plain steps of `num_rows` rows is lowered from."""
        replicated, layout = self._arguments.replicated, self._sampling_layout(num_rows)
        logits = jax.ShapeDtypeStruct((num_rows, self._vocab_size), np.float32, sharding=replicated)
        packed = jax.ShapeDtypeStruct((layout.size,), np.int32, sharding=replicated)
        return ProgramCall(self._sampling, "run_packed_sampling", (logits, packed, self._abstract_allowed(num_rows)),
                           dict(layout=layout, num_top_logprobs=self._config.max_logprobs,
                                max_rows=self._buckets.max_rows, truncation=truncation))

    def _abstract_allowed(self, num_rows: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((num_rows, self._arguments.mask_width), np.int32,
                                    sharding=self._arguments.replicated)

    def _sampling_row_counts(self) -> list[int]:
        """The row counts of the plain buckets: one sampling program each."""
        return sorted({bucket.num_seqs for bucket in self._buckets.all_buckets() if splits(bucket)})

    def _sampling_layout(self, num_rows: int) -> PackedLayout:
        if num_rows not in self._sampling_layouts:
            padding = self._inputs.padding_arrays(StepBucket(num_rows, num_rows))
            self._sampling_layouts[num_rows] = PackedLayout.of(padding.sampling)
        return self._sampling_layouts[num_rows]


def compile_lowerings(programs: list[ProgramLowering], guard: CompileGuard,
                      keep: Callable[[ProgramLowering, jax.stages.Compiled], None], progress: bool,
                      store: ProgramStore | None = None) -> WarmupStats:
    """Lowers each program here and compiles it on a thread pool (XLA compiles release the GIL), one per core, while
    the next ones lower; `keep` receives each compiled program. With a `store`, a program kept there is loaded
    instead (not traced, lowered or compiled), and each one XLA compiled is written to it (the persistent cache off
    where the store asks to be filled: ProgramStore.compile_afresh). Two bars count programs lowered and ready, the
    second with where they came from (store, compilation cache, compiled).

    The store is read before any compile starts and written after the last one ends: XLA:CPU loads and serializes
    executables through the same code generator its compiles use, and an XLA:CPU compile crashed (a segfault) while
    the store was read and written beside the compiling threads."""
    started = time.perf_counter()
    sources = collections.Counter()

    def compile_watched(lowered: jax.stages.Lowered, compiler_options: dict) -> tuple[jax.stages.Compiled, str]:
        with guard.watch(), counting_compiles() as counts:
            compiled = lowered.compile(compiler_options=compiler_options or None)
        return compiled, "compiled" if counts.compiled else "cache"

    def ready(program: ProgramLowering, compiled: jax.stages.Compiled, source: str) -> None:
        keep(program, compiled)
        sources[source] += 1
        compiled_bar.set_postfix(sources, refresh=False)
        compiled_bar.update()

    afresh = store is not None and store.compile_afresh
    with (compiling_afresh() if afresh else contextlib.nullcontext(),
          _program_bar("compile", len(programs), progress) as compiled_bar):
        store_started = time.perf_counter()
        pending = []  # (program, its store key and call, or None): those the store does not hold
        for program in programs:
            stored = _stored_as(store, program)
            loaded = store.load(program.stored_name, *stored) if stored is not None else None
            if loaded is not None:
                ready(program, loaded, "store")  # never lowered
            else:
                pending.append((program, stored))
        store_seconds = time.perf_counter() - store_started
        lower_seconds, to_save = 0.0, []
        with (concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as workers,
              _program_bar("lower", len(pending), progress and bool(pending)) as lowered_bar):
            compiling = {}
            for program, stored in pending:
                lower_started = time.perf_counter()
                with guard.watch():
                    lowered = stored[1].lower() if stored is not None else program.lower()
                lower_seconds += time.perf_counter() - lower_started
                lowered_bar.update()
                compiling[workers.submit(compile_watched, lowered, program.compiler_options)] = (program, stored)
            for done in concurrent.futures.as_completed(compiling):
                (program, stored), (compiled, source) = compiling[done], done.result()
                # Only a program XLA compiled here is whole: one a compilation cache handed back lacks code (XLA:CPU)
                if stored is not None and source == "compiled":
                    to_save.append((program.stored_name, stored[0], compiled))
                ready(program, compiled, source)
        store_started = time.perf_counter()
        saved = sum(store.save(name, key, compiled) for name, key, compiled in to_save)
        store_seconds += time.perf_counter() - store_started
    if store is not None and sources["cache"]:
        store.note_uncompiled(sources["cache"])
    return WarmupStats(len(programs), lower_seconds, time.perf_counter() - started, ProgramSources(**sources),
                       store_seconds, saved)


def _stored_as(store: ProgramStore | None, program: ProgramLowering) -> tuple[str, ProgramCall] | None:
    """The program's key in the store and what it is lowered from; None when it is not to be stored."""
    if store is None or program.call is None:
        return None
    call = program.call()
    try:
        return program_key(store.scope, call.signature(), program.compiler_options), call
    except UnstableKeyError as error:
        store.warn_once(f"the {program.stored_name} program is compiled, not stored: {error}")
        return None


def packed_tree(bucket: StepBucket, arrays: StepArrays):
    """What the bucket's transfer buffer holds: its StepArrays, or for a plain bucket (sampling tensors, the rest), so
    that the sampling tensors lead the buffer and its sampler reads the same words whatever the bucket."""
    return (arrays.sampling, dataclasses.replace(arrays, sampling=None)) if splits(bucket) else arrays


def splits(bucket: StepBucket) -> bool:
    """A plain bucket runs as a forward program and a sampling program; other variants (penalties, prompt scores,
    drafts: their samplers read more than the sampled rows' logits) as one program."""
    return not (bucket.penalties or bucket.prompt_logits or bucket.drafts)


def _program_bar(verb: str, total: int, shown: bool) -> tqdm:
    """A bar of step programs `verb`-ed; bars open together take a line each."""
    return tqdm(total=total, desc=f"{verb} {total} step programs", unit="program", disable=not shown,
                mininterval=0.5)


def temp_bytes(program: jax.stages.Compiled) -> int:
    """The program's temporary memory on one device, from XLA's analysis (0 where the backend gives none)."""
    analysis = program.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else 0
