"""`ModelRunner`: turns scheduled chunks into padded device inputs and runs the AOT-compiled step for their bucket.

Every bucket is compiled at start-up (runner/step_programs.py), against abstract weights and pool (shapes, dtypes
and shardings only), so compiling needs neither the weights nor the pool and can run while the weights load; after
that a compile is a bug that the CompileGuard raises (or logs). The KV pool lives here and is donated through every step. Steps are
dispatched asynchronously: `execute` returns at once with a `PendingStep`, whose sampled tokens start copying to
the host right away, so the caller can schedule the next step while this one runs.

With a mesh over several processes the runner steps in lockstep (jaxserve/runner/lockstep.py): on the leader
`execute` also broadcasts each step's bucket and inputs, and the other processes run `follow`, which receives them
and launches the same program.

A step holding chunks that score prompt tokens (prompt_logprobs) runs the bucket's prompt-logits variant, which also
returns, for every token of those chunks, the log-probability of the next prompt token; the host reads them back
together with the samples. A step holding speculative drafts runs the bucket's verifying variant
(jaxserve/runner/speculative.py), which returns, per row, the accepted drafts and the token sampled after them.

A plain step (no penalties, prompt scores or drafts: most steps) runs as two programs, the forward pass of its bucket
and the sampler of its row count (runner/step.py), dispatched by `start` and `finish`: between the two the engine
reads the previous step back and fills the grammar masks of structured output while the forward pass runs. Other
variants run as one program, dispatched by `finish`. The token masks (i32[S, ceil(vocab / 32)]) are a program input
of their own (runner/token_masks.py), so a step without structured output sends none.

A pooling engine's runner (`--runner pooling`) compiles pooling programs instead (runner/pooling_programs.py): its
steps, dispatched by `run_pooling`, return each prompt chunk's pooled hidden states rather than a sample.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.checkpoint.lora_slots import SlotWeights
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import projection_format
from jaxserve.model.kv_quantization import kv_pool_dtype
from jaxserve.model.paged_kv_cache import PagedKVCache
from jaxserve.parallel import KV_POOL_SPEC, logits_partition_spec, make_tp_mesh
from jaxserve.parallel.process_group import abort_group
from jaxserve.runner.attention_check import checked_attention_backend
from jaxserve.runner.buckets import BucketSet, StepBucket
from jaxserve.runner.compile_guard import CompileGuard
from jaxserve.runner.compile_options import StepCompilerOptions
from jaxserve.runner.lockstep import StepChannel, spans_processes
from jaxserve.runner.lora_slots import DeviceLoraSlots
from jaxserve.runner.pooling_programs import PoolingPrograms
from jaxserve.runner.pooling_step import PendingPooling
from jaxserve.runner.program_keys import StoreScope
from jaxserve.runner.program_store import ProgramStore
from jaxserve.runner.sampler import needs_truncation
from jaxserve.runner.step import LogitsShardings, StepArrays, StepResult
from jaxserve.runner.step_inputs import StepInputBuilder
from jaxserve.runner.step_programs import AbstractArguments, StepPrograms, packed_tree, splits
from jaxserve.runner.step_results import PendingStep, prompt_spans
from jaxserve.runner.token_masks import StepMasks
from jaxserve.schedule import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class StartedStep:
    """A step whose inputs are prepared and on the devices; a plain step's forward program already runs.
    `ModelRunner.finish` dispatches the rest."""

    schedule: SchedulerOutput  # what it computes
    bucket: StepBucket  # its compiled shape
    host_arrays: StepArrays  # its padded inputs (sampling.allowed: None)
    # f32[S, vocab]: the logits of the rows to sample, from the forward program already dispatched; None: nothing is
    # dispatched yet (a variant that runs as one program, or lockstep, which launches both programs at once)
    logits: jax.Array | None
    sampling_inputs: jax.Array | None  # i32[size]: the packed sampling tensors, on the devices, with logits

    @property
    def forward_running(self) -> bool:
        """Its forward pass was dispatched: the masks given to `finish` may follow tokens read back meanwhile."""
        return self.logits is not None


class ModelRunner:
    """Owns the weights, the KV pool and the compiled step programs.

    The weights given may be abstract (`jax.ShapeDtypeStruct` leaves with their shardings): programs compile
    against them, and `load_params` attaches the real ones before the first step.

    Under tensor parallelism (`mesh` with more than one device) the weights arrive sharded by the rules, the pool is
    split over KV heads, and every step input and output other than the pool is replicated: each program's
    in/out shardings match what the next step passes in, so nothing is resharded between steps and nothing
    recompiles.

    A `compile_only` runner builds the programs for devices that are described, not at hand (a GPU target compiled
    on any machine: jaxserve/gpu_programs): it places nothing on its mesh, so it can lower and compile every
    program but never allocate a pool or run a step. Its attention is the one the config names for the mesh's
    platform, unchecked, since the check runs the kernel.
    """

    def __init__(self, model_config: LlamaConfig, graphdef: nnx.GraphDef, params: nnx.State, dtype,
                 config: EngineConfig, mesh: Mesh | None = None,
                 kv_cache_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
                 compile_only: bool = False):
        self.config = config
        self.model_config = model_config
        self.graphdef = graphdef  # the model's structure and static attributes; its weights are `params`
        self.params = params  # abstract until load_params, where given so
        self._abstract_params = jax.tree.map(_abstract, params)
        self.dtype = dtype  # of the weights and activations
        self.kv_dtype = kv_pool_dtype(config.kv_cache_dtype, dtype)  # of the KV pool's pages
        # A float8 pool's (K, V) scales per layer, from the checkpoint; None: 1.0
        self.kv_cache_scales = kv_cache_scales
        self.mesh = mesh if mesh is not None else make_tp_mesh(1)  # the weights' tensor-parallel mesh
        self.attention_backend = (config.attention_implementation(self.mesh.devices.flat[0].platform) if compile_only
                                  else checked_attention_backend(config, dtype, self.kv_dtype))
        self._replicated = NamedSharding(self.mesh, P())
        self._pool_sharding = NamedSharding(self.mesh, KV_POOL_SPEC)
        self.buckets = BucketSet.for_limits(config.require("max_num_batched_tokens"), config.require("max_num_seqs"),
                                            speculative=config.speculative_config is not None)
        # Drafts per row of a verifying step (K), fixing its programs' shapes; 0 without speculative decoding.
        self.num_speculative_tokens = (config.speculative_config.num_speculative_tokens
                                       if config.speculative_config is not None else 0)
        self.guard = CompileGuard(raise_on_compile=config.raise_on_compile)
        self.pool: PagedKVCache | None = None  # allocated once sized: allocate_pool
        last_tokens = np.zeros(self.buckets.max_rows, np.int32)  # i32[max_rows]
        self._last_tokens = (_abstract_of(last_tokens, self._replicated) if compile_only
                             else jax.device_put(last_tokens, self._replicated))
        logits_shardings = LogitsShardings(
            computed=NamedSharding(self.mesh, logits_partition_spec(model_config.vocab_size, self.mesh)),
            sampled=self._replicated)
        # The LoRA adapter slots on the devices; None: the engine serves no adapters.
        self.lora = (DeviceLoraSlots(model_config, self.mesh, config.max_loras, config.max_lora_rank, dtype,
                                     placed=not compile_only)
                     if config.enable_lora else None)
        # Each step's padded host inputs, and the rows of recent sequences they are built from.
        self.inputs = StepInputBuilder(config, self.buckets, self.num_speculative_tokens, self.lora is not None)
        self._masks = StepMasks(model_config.vocab_size, self._to_devices)  # the steps' grammar token masks
        arguments = AbstractArguments(
            params=self._abstract_params, pool=self._pool_shape, pool_shardings=self._pool_leaf_shardings(),
            last_tokens=_abstract(self._last_tokens), replicated=self._replicated, logits=logits_shardings,
            lora=jax.tree.map(_abstract, self.lora.stack) if self.lora is not None else None,
            mask_width=self._masks.width)
        # The compiled programs of every bucket (compiled by warm_up) and their transfer buffers' layouts: a
        # pooling engine's (--runner pooling) pool hidden states instead of sampling (run_pooling)
        platform = self.mesh.devices.flat[0].platform
        weight_format = projection_format(nnx.merge(graphdef, self._abstract_params))
        step_options = StepCompilerOptions(platform, config.gemm_backend, _has_quantized_weights(params),
                                           weight_format)
        stacked_gemm = config.stacked_gemm(platform, weight_format is not None and weight_format.packs_int4)
        self.programs = (PoolingPrograms(graphdef, arguments, config, self.buckets, step_options, self.guard)
                         if config.pooling else
                         StepPrograms(graphdef, arguments, config, model_config.vocab_size, self.buckets, self.inputs,
                                      step_options, self.guard, stacked_gemm,
                                      self.mesh.abstract_mesh if compile_only else None))
        self.bucket_counts: collections.Counter[StepBucket] = collections.Counter()  # steps run per bucket
        # The per-step broadcast when the mesh spans processes; None on one process.
        self._channel = (StepChannel(self.buckets.all_buckets(), self._padding_message) if spans_processes(self.mesh)
                         else None)
        if self._channel is not None and self.lora is not None:
            raise ConfigError("LoRA adapters (enable_lora) do not run on a mesh over several processes yet")
        if self._channel is not None and config.pooling:
            raise ConfigError("the pooling runner (--runner pooling) does not run on a mesh over several processes yet")

    def store_scope(self) -> StoreScope:
        """What every program of this runner shares in a program store's keys (runner/program_keys.py)."""
        return StoreScope.of(self.model_config, self.graphdef, self.mesh)

    def write_lora_slot(self, slot: int, weights: SlotWeights) -> None:
        """Puts one adapter (or an empty slot's zeros) into `slot` for the steps dispatched from now on; a step
        already in flight keeps the slots it was given (the write makes new arrays)."""
        self.lora.write(slot, weights)

    def load_params(self, params: nnx.State) -> None:
        """Attaches the real weights, which must match the abstract ones the programs were compiled for."""
        if jax.tree.map(_abstract, params) != self._abstract_params:
            raise ValueError("the loaded weights differ in shape, dtype or sharding from those compiled for")
        self.params = params

    def allocate_pool(self, num_pages: int) -> None:
        """The zeroed KV pool of `num_pages` pages (the null page included) that every step donates and gets back."""
        self.pool = self._fresh_pool(num_pages)

    def warm_up(self, num_pages: int, progress: bool = True, store: ProgramStore | None = None) -> None:
        """Compiles every program ahead of time for a pool of `num_pages` pages (StepPrograms.compile_all), or loads
        it from `store` (a ProgramStore of `store_scope()`), then arms the guard: no compile may follow. Needs
        neither the weights nor the pool."""
        if store is not None:
            self.programs.compile_all(num_pages, progress, store)
        else:
            self.programs.compile_all(num_pages, progress)
        if self.lora is not None:
            self.lora.compile_writer(self.guard)
        if self._channel is not None:
            with self.guard.watch():
                self._channel.warm_up()
        self.guard.arm()

    def execute(self, schedule: SchedulerOutput,
                masks: dict[int, np.ndarray] | None = None) -> PendingStep:  # row -> i32[W]
        """Dispatches the scheduled step and returns without waiting; `masks`: the token masks of the rows that
        have one (structured output), by row."""
        return self.finish(self.start(schedule), masks or {})

    def start(self, schedule: SchedulerOutput) -> StartedStep:
        """Prepares the step and puts its inputs on the devices; a plain step's forward program starts running."""
        with self.guard.watch():
            with jax.profiler.TraceAnnotation("prepare"):
                bucket, host_arrays = self.inputs.prepare(schedule)
            if not splits(bucket) or self._channel is not None:
                return StartedStep(schedule, bucket, host_arrays, logits=None, sampling_inputs=None)
            with jax.profiler.TraceAnnotation("forward"):
                logits, sampling_inputs = self._run_forward(bucket, self.transfer(bucket, host_arrays))
            return StartedStep(schedule, bucket, host_arrays, logits, sampling_inputs)

    def finish(self, started: StartedStep,
               masks: dict[int, np.ndarray]) -> PendingStep:  # row -> i32[W]: rows with a token mask
        """Dispatches the rest of a started step (its sampler, or its whole program) and returns without waiting."""
        bucket, chunks = started.bucket, started.schedule.sequences
        with self.guard.watch(), jax.profiler.TraceAnnotation("sample"):
            allowed = self._masks.host(bucket.num_seqs, masks)
            if started.forward_running:
                sampler = self.programs.sampler(bucket.num_seqs, needs_truncation(started.host_arrays.sampling))
                result = sampler(started.logits, started.sampling_inputs, self._masks.device(bucket.num_seqs, allowed))
                self._last_tokens = result.last_tokens
            else:
                if self._channel is not None:
                    self._channel.send_step(bucket, (started.host_arrays, self._masks.whole(bucket.num_seqs,
                                                                                             allowed)))
                result = self._run_program(bucket, started.host_arrays, allowed)
        self.inputs.record_samples(chunks)
        return PendingStep(result, len(chunks), prompt_spans(chunks) if bucket.prompt_logits else (),
                           draft_rows=[row for row, c in enumerate(chunks) if c.num_draft_tokens])

    def run_pooling(self, schedule: SchedulerOutput) -> PendingPooling:
        """A pooling engine's step: dispatches the bucket's pooling program on the scheduled prompt chunks and
        returns without waiting; the PendingPooling reads back each chunk's pooled vector."""
        with self.guard.watch():
            with jax.profiler.TraceAnnotation("prepare"):
                bucket, host_arrays = self.programs.prepare(schedule.sequences, schedule.num_batched_tokens)
                packed = self._to_devices(self.programs.layout(bucket).pack(host_arrays))
            with jax.profiler.TraceAnnotation("pool"):
                pooled, self.pool = self.programs.step(bucket)(self.params, self.pool, packed)
            self.bucket_counts[bucket] += 1
        return PendingPooling(pooled, len(schedule.sequences))

    def replace_lost_pool(self) -> None:
        """After a failed step: a pool whose buffers the failed program consumed (donation) is replaced by zeros.

        Its contents belonged to the requests the failure ended, so nothing of value is lost. In a lockstep group a
        failed step leaves the followers out of step (or a peer is gone), so the group ends instead.
        """
        if self._channel is not None:
            abort_group("a step failed while the group ran in lockstep")
        if any(page.is_deleted() for page in jax.tree.leaves(self.pool)):
            self.pool = self._fresh_pool(self.pool.num_pages)
        self.inputs.forget_samples()

    def _fresh_pool(self, num_pages: int) -> PagedKVCache:
        return PagedKVCache.zeros(*self._pool_dims(num_pages), attention_backend=self.attention_backend,
                                  pool_sharding=self._pool_sharding, float8_scales=self.kv_cache_scales)

    def _pool_shape(self, num_pages: int) -> PagedKVCache:
        """The pool's shapes, dtypes and shardings (nothing allocated)."""
        shapes = jax.eval_shape(functools.partial(self._fresh_pool, num_pages))
        return jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes,
                            self._pool_leaf_shardings())

    def _pool_leaf_shardings(self) -> PagedKVCache:
        """Each pool array's sharding: the pages split over KV heads, a float8 pool's per-layer scales replicated."""
        shapes = jax.eval_shape(functools.partial(self._fresh_pool, 2))
        return jax.tree.map(lambda x: self._pool_sharding if x.ndim == len(KV_POOL_SPEC) else self._replicated,
                            shapes)

    def _pool_dims(self, num_pages: int) -> tuple:
        cfg = self.model_config
        return (cfg.num_hidden_layers, num_pages, self.config.block_size, cfg.num_key_value_heads, cfg.head_dim,
                self.kv_dtype)

    def _run_program(self, bucket: StepBucket, host_arrays: StepArrays,
                     allowed: np.ndarray | None) -> StepResult:  # i32[S, W] token masks; None: all allowed
        """Launches the whole step (both programs of a plain bucket) on the pool; the same call on every process
        of a lockstep group."""
        with jax.profiler.TraceAnnotation("step"):
            step_inputs = self.transfer(bucket, host_arrays)
            device_allowed = self._masks.device(bucket.num_seqs, allowed)
            if splits(bucket):
                sampler = self.programs.sampler(bucket.num_seqs, needs_truncation(host_arrays.sampling))
                result = sampler(*self._run_forward(bucket, step_inputs), device_allowed)
            else:
                result, self.pool = self.programs.step(bucket)(self.params, self.pool, self._last_tokens, step_inputs,
                                                           device_allowed, self._lora_stack())
                self.bucket_counts[bucket] += 1
        self._last_tokens = result.last_tokens
        return result

    def _run_forward(self, bucket: StepBucket, step_inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Launches a plain bucket's forward program: (its logits f32[S, vocab], the packed sampling tensors)."""
        outputs, self.pool = self.programs.step(bucket)(self.params, self.pool, self._last_tokens, step_inputs,
                                                    self._lora_stack())
        self.bucket_counts[bucket] += 1
        return outputs

    def _lora_stack(self):
        return self.lora.stack if self.lora is not None else None

    def transfer(self, bucket: StepBucket, host_arrays: StepArrays) -> jax.Array:
        """The step's inputs packed into one buffer (i32[size]) and put on the devices: the host's last share of a
        step before its programs run."""
        return self._to_devices(self.programs.layout(bucket).pack(packed_tree(bucket, host_arrays)))

    def _padding_message(self, bucket: StepBucket) -> tuple[StepArrays, np.ndarray]:
        """What a lockstep message of the bucket carries, with its shapes: the step's arrays and its masks."""
        return self.inputs.padding_arrays(bucket), self._masks.whole(bucket.num_seqs, None)

    def _to_devices(self, packed: np.ndarray) -> jax.Array:
        """The step's inputs (i32[size], PackedLayout), replicated over the mesh in one transfer.

        Over processes each one builds its addressable shards from its own copy (identical after the broadcast):
        `device_put` would instead check that they agree with one more collective, every step.
        """
        if self._channel is None:
            return jax.device_put(packed, self._replicated)
        return jax.make_array_from_process_local_data(self._replicated, packed)

    @property
    def is_follower(self) -> bool:
        """This process runs the leader's steps (`follow`) rather than scheduling its own."""
        return self._channel is not None and not self._channel.is_leader

    def follow(self) -> None:
        """Follower: runs every step the leader broadcasts until the leader stops; results stay on the devices."""
        while (step := self._channel.receive()) is not None:
            bucket, (host_arrays, allowed) = step
            with self.guard.watch():
                self._run_program(bucket, host_arrays, allowed)

    def stop_followers(self) -> None:
        """Leader: ends the followers' `follow` loops (nothing to do on one process)."""
        if self._channel is not None and self._channel.is_leader:
            self._channel.send_stop()

def _has_quantized_weights(params: nnx.State) -> bool:
    """Some weight is stored in one byte (int8 or a float8): quantized, as loaded or as the checkpoint was."""
    return any(np.dtype(leaf.dtype).itemsize == 1 and np.dtype(leaf.dtype) != np.bool_
               for leaf in jax.tree.leaves(params))


def _abstract(x) -> jax.ShapeDtypeStruct:
    """An array's (or placeholder's) shape, dtype and sharding."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _abstract_of(host: np.ndarray, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """What a host array would be once placed with `sharding`, without placing it."""
    return jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)
