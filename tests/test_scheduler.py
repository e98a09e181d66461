"""Scheduler against a fake runner whose simulated KV pool stores token ids.

The runner samples each token from the context it reads back through the block table, so a wrong page, a false
prefix hit, a page freed too early or a mis-substituted pending token changes the outputs, which are compared with a
closed-form reference.
"""

import collections
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.engine.request import Request, RequestStatus
from jaxserve.config import EngineConfig
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import ConfigError, InvalidRequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import PENDING_TOKEN, SchedulerOutput

VOCAB = 29
EOS = 0
MAX_ITERATIONS = 3000


def next_token(context) -> int:
    state = 0
    for token in context:
        state = (state * 31 + token + 7) % 1_000_003
    return state % VOCAB


def reference_outputs(prompt, max_tokens) -> list[int]:
    context, outputs = list(prompt), []
    while len(outputs) < max_tokens and (not outputs or outputs[-1] != EOS):
        outputs.append(next_token(context))
        context.append(outputs[-1])
    return outputs


@dataclasses.dataclass(frozen=True)
class Work:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0  # engine loop iteration that receives the request
    prompt_logprobs: int | None = None
    priority: int = 0  # sent only under the priority policy (fcfs refuses any other)


class FakeRunner:
    """Executes batches in order, as the device does: step N's writes land before step N+1 reads."""

    def __init__(self, scheduler: Scheduler, overlap: bool):
        self.pool, self.page_size, self.overlap = scheduler.pool, scheduler.page_size, overlap
        self.kv: dict[int, list[int | None]] = {}  # page -> token id written at each slot
        self.truth: dict[str, list[int]] = {}  # prompt plus every token sampled for the request
        self.last_sample: dict[str, tuple[int, int]] = {}  # request -> (step, token) of its latest sample

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        # Reads see only earlier steps' writes: a page must not be read in the batch that writes it.
        contexts = {s.request_id: self._read_context(s) for s in output.sequences}
        sampled = {}
        for seq in output.sequences:
            chunk = self._substitute_pending(seq, output.step)
            context = contexts[seq.request_id] + chunk
            assert context == self.truth[seq.request_id][:len(context)]
            self._write(seq, chunk)
            if seq.samples:
                token = next_token(context)
                self.truth[seq.request_id].append(token)
                self.last_sample[seq.request_id] = (output.step, token)
                sampled[seq.request_id] = token
        return sampled

    def _read_context(self, seq) -> list[int]:
        assert len(seq.page_ids) == -(-(seq.start_position + seq.num_tokens) // self.page_size)
        return [self.kv[seq.page_ids[p // self.page_size]][p % self.page_size] for p in range(seq.start_position)]

    def _substitute_pending(self, seq, step: int) -> list[int]:
        chunk = list(seq.token_ids)
        if PENDING_TOKEN in chunk:
            assert self.overlap and chunk == [PENDING_TOKEN], "pending tokens only as a decode input under overlap"
            sampled_step, chunk[0] = self.last_sample[seq.request_id]
            assert sampled_step == step - 1
        return chunk

    def _write(self, seq, chunk: list[int]) -> None:
        for position, token in enumerate(chunk, start=seq.start_position):
            page = seq.page_ids[position // self.page_size]
            assert self.pool.refcount(page) == 1, "writing into a page another request shares"
            self.kv.setdefault(page, [None] * self.page_size)[position % self.page_size] = token


class FakeEngine:
    """The engine loop: schedule, execute, then update (overlap: schedule N+1 before updating N)."""

    def __init__(self, config: EngineConfig, overlap: bool = False):
        self.scheduler = Scheduler(config)
        self.runner = FakeRunner(self.scheduler, overlap)
        self.overlap = overlap
        self.results: dict[str, list[int]] = {}
        self.outputs: list[SchedulerOutput] = []
        self.added: list[str] = []

    def add(self, request_id: str, work: Work) -> None:
        by_priority = self.scheduler.config.scheduling_policy == "priority"
        params = SamplingParams(max_tokens=work.max_tokens, prompt_logprobs=work.prompt_logprobs,
                                priority=work.priority if by_priority else 0)
        self.scheduler.add_request(Request(request_id, work.prompt, params, arrival_index=len(self.added)))
        self.runner.truth[request_id] = list(work.prompt)
        self.added.append(request_id)

    def run(self, workload: list[Work], aborts: dict[int, list[int]] | None = None) -> dict[str, list[int]]:
        in_flight = None
        last_arrival = max(work.arrival for work in workload)
        for iteration in range(MAX_ITERATIONS):
            for index, work in enumerate(workload):
                if work.arrival == iteration:
                    self.add(f"r{index}", work)
            if iteration > last_arrival and not self.scheduler.has_unfinished_requests() and in_flight is None:
                return self.results
            running_before = {rid for rid in self.added if self._status(rid) is RequestStatus.RUNNING}
            output = self.scheduler.schedule()
            self.outputs.append(output)
            check_step(self.scheduler, output, self.added, running_before, self.runner.truth)
            sampled = self.runner.execute(output)
            for index in (aborts or {}).get(iteration, ()):
                self.scheduler.abort_request(f"r{index}")  # with this step in flight
            if self.overlap:
                if in_flight is not None:
                    self.apply(*in_flight)
                in_flight = (output, sampled) if output.sequences else None
            else:
                self.apply(output, sampled)
        raise AssertionError("the workload did not finish")

    def apply(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        self.scheduler.update_from_output(output, sampled)
        for request_id in sampled:
            request = self.scheduler.get_request(request_id)
            if request is None:
                continue
            known = request.output_token_ids[:request.num_output_tokens - request.num_pending_tokens]
            if known and (len(known) == request.max_new_tokens or known[-1] == EOS):
                self.results[request_id] = known
                self.scheduler.finish_request(request_id, "stop")

    def _status(self, request_id: str) -> RequestStatus | None:
        request = self.scheduler.get_request(request_id)
        return request.status if request else None

    @property
    def total_batched_tokens(self) -> int:
        return sum(output.num_batched_tokens for output in self.outputs)


def check_step(scheduler: Scheduler, output: SchedulerOutput, request_ids, running_before: set, truth) -> None:
    config, pool, num_pages = scheduler.config, scheduler.pool, scheduler.num_pages
    assert output.num_batched_tokens == sum(s.num_tokens for s in output.sequences)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.sequences) <= config.max_num_seqs
    assert len({s.request_id for s in output.sequences}) == len(output.sequences)
    for seq in output.sequences:
        assert seq.num_tokens > 0 and all(1 <= page < num_pages for page in seq.page_ids)
        assert seq.samples or config.enable_chunked_prefill  # without chunking a prompt goes whole
    preempted = [scheduler.get_request(r) for r in running_before
                 if scheduler.get_request(r) is not None and scheduler.get_request(r).status is RequestStatus.PREEMPTED]
    assert all(not request.page_ids for request in preempted)
    live = [scheduler.get_request(r) for r in request_ids if scheduler.get_request(r) is not None]
    running = [r for r in live if r.status is RequestStatus.RUNNING]
    admitted = [r for r in running if r.request_id not in running_before]
    waiting = [r for r in live if r.status is not RequestStatus.RUNNING]
    if preempted:
        # A shortage admits nobody, so no victim restarts at once; a preemption for a waiting request (priority
        # policy) admits that one alone, ranked ahead of its victims and strictly more urgent.
        assert len(admitted) <= 1
        assert all(new.rank < victim.rank and new.params.priority < victim.params.priority
                   for new in admitted for victim in preempted)
    # One rank orders both queues: victims rank below every request kept, the admitted above every one left waiting
    # (unless the partial-prefill limits passed a long one over).
    assert all(victim.rank > kept.rank for victim in preempted for kept in running)
    if config.max_num_partial_prefills == 1:
        assert all(new.rank < left.rank for new in admitted for left in waiting)
    holders = collections.defaultdict(list)
    for request_id in request_ids:
        request = scheduler.get_request(request_id)
        for index, page in enumerate(request.page_ids if request else ()):
            holders[page].append((request, index))
    for page in range(1, num_pages):
        assert pool.refcount(page) == len(holders[page])
    for page, owners in holders.items():
        if len(owners) > 1:  # shared only through the prefix cache: same full prefix, computed by all
            end = (owners[0][1] + 1) * scheduler.page_size
            assert len({(index, tuple(truth[r.request_id][:end])) for r, index in owners}) == 1
            assert all(r.num_computed_tokens >= end for r, _ in owners)
    assert pool.num_used + pool.num_free + pool.num_cached == num_pages - 1


def assert_pool_drained(scheduler: Scheduler) -> None:
    pool, stats = scheduler.pool, scheduler.stats()
    assert all(pool.refcount(page) == 0 for page in range(pool.num_pages))
    assert stats.num_pages_used == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_pages_free + stats.num_pages_cached == pool.num_pages - 1
    assert not scheduler.has_unfinished_requests()


def make_config(**overrides) -> EngineConfig:
    fields = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48, block_size=4, num_kv_pages=64)
    return EngineConfig(**{**fields, **overrides})


@st.composite
def workloads(draw, max_requests: int = 7):
    shared = draw(st.lists(st.integers(1, 3), max_size=12))
    items = []
    for _ in range(draw(st.integers(1, max_requests))):
        own = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12))
        prompt = tuple((shared if draw(st.booleans()) else []) + own)
        items.append(Work(prompt, draw(st.integers(1, 10)), arrival=draw(st.integers(0, 5)),
                          priority=draw(st.integers(-2, 2))))
    return items


@st.composite
def configs(draw, workload: list[Work], chunked: bool, caching: bool):
    # The tightest admissible pool fits the largest request alone; a few pages more force preemption often.
    page_size = 4
    tightest = 1 + max(-(-(len(w.prompt) + w.max_tokens - 1) // page_size) for w in workload)
    budget = draw(st.integers(6, 64) if chunked else st.integers(48, 64))
    return make_config(max_num_seqs=draw(st.integers(1, 5)), max_num_batched_tokens=budget, block_size=page_size,
                       num_kv_pages=draw(st.integers(tightest, tightest + 6)), enable_chunked_prefill=chunked,
                       enable_prefix_caching=caching, scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
                       priority_aging_steps=draw(st.integers(1, 8)))


MODES = [(chunked, caching, overlap) for chunked in (True, False) for caching in (True, False)
         for overlap in (False, True)]


@pytest.mark.parametrize("chunked,caching,overlap", MODES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_request_gets_its_reference_outputs(chunked, caching, overlap, data):
    workload = data.draw(workloads())
    engine = FakeEngine(data.draw(configs(workload, chunked, caching)), overlap)
    results = engine.run(workload)
    assert results == {f"r{i}": reference_outputs(w.prompt, w.max_tokens) for i, w in enumerate(workload)}
    assert_pool_drained(engine.scheduler)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), chunked=st.booleans(), caching=st.booleans(), overlap=st.booleans())
def test_aborts_at_any_point_leak_no_pages(data, chunked, caching, overlap):
    workload = data.draw(workloads())
    aborts = data.draw(st.dictionaries(st.integers(0, 25), st.lists(st.integers(0, len(workload) - 1), max_size=2)))
    engine = FakeEngine(data.draw(configs(workload, chunked, caching)), overlap)
    results = engine.run(workload, aborts)
    for request_id, outputs in results.items():
        work = workload[int(request_id[1:])]
        assert outputs == reference_outputs(work.prompt, work.max_tokens)
    assert_pool_drained(engine.scheduler)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("caching", [False, True])
def test_tiny_pool_preempts_and_still_matches_the_unpreempted_run(overlap, caching):
    workload = [Work(tuple(range(i + 1, i + 9)), max_tokens=14) for i in range(4)]
    roomy = FakeEngine(make_config(num_kv_pages=64, enable_prefix_caching=caching), overlap)
    tight = FakeEngine(make_config(num_kv_pages=7, enable_prefix_caching=caching), overlap)
    expected = roomy.run(workload)
    assert tight.run(workload) == expected
    assert roomy.scheduler.stats().num_preemptions == 0
    assert tight.scheduler.stats().num_preemptions > 0
    assert_pool_drained(tight.scheduler)


def test_preemption_takes_the_newest_request_which_resumes_first():
    scheduler = Scheduler(make_config(num_kv_pages=4, max_model_len=16, enable_prefix_caching=False))
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", (1, 2, 3, index + 4), SamplingParams(max_tokens=8), index))
    first = scheduler.schedule()  # each prompt fills one of the three pages
    assert [s.request_id for s in first.sequences] == ["r0", "r1", "r2"]
    scheduler.update_from_output(first, {"r0": 5, "r1": 6, "r2": 7})
    second = scheduler.schedule()  # each decode needs a second page: only one is free
    assert [scheduler.get_request(r).status for r in ("r1", "r2")] == [RequestStatus.PREEMPTED] * 2
    assert [s.request_id for s in second.sequences] == ["r0"]
    scheduler.update_from_output(second, {"r0": 8})
    scheduler.finish_request("r0", "stop")
    third = scheduler.schedule()
    resumed = third.sequences[0]
    assert (resumed.request_id, resumed.start_position, resumed.token_ids) == ("r1", 0, (1, 2, 3, 5, 6))
    assert scheduler.get_request("r2").status is RequestStatus.PREEMPTED
    scheduler.abort_request("r2")  # while preempted
    scheduler.abort_request("r1")  # while its step is in flight
    scheduler.update_from_output(third, {"r1": 9})
    assert_pool_drained(scheduler)


def _step(scheduler: Scheduler) -> list[str]:
    """One step without overlap, every sample read back as token 9; the ids the step computed, in batch order."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, {s.request_id: 9 for s in output.sequences if s.samples})
    return [s.request_id for s in output.sequences]


def _request(request_id: str, prompt: tuple[int, ...], priority: int, arrival: int) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=8, priority=priority), arrival)


def test_priority_admits_the_most_urgent_first_then_by_arrival():
    scheduler = Scheduler(make_config(scheduling_policy="priority", max_num_seqs=3))
    for index, priority in enumerate([1, 0, 0, -1, 1]):
        scheduler.add_request(_request(f"r{index}", (1, 2, 3), priority, index))
    assert _step(scheduler) == ["r3", "r1", "r2"]


def test_priority_preempts_the_least_urgent_not_the_newest():
    scheduler = Scheduler(make_config(scheduling_policy="priority", num_kv_pages=5, max_model_len=16,
                                      enable_prefix_caching=False))
    for index, priority in enumerate([0, 1, 0]):  # one page each; the first decodes take the fourth page
        scheduler.add_request(_request(f"r{index}", (1, 2, 3, index + 4), priority, index))
    assert _step(scheduler) == ["r0", "r2", "r1"]  # running requests are served in rank order too
    assert _step(scheduler) == ["r0", "r2"]  # fcfs would have preempted r2, the newest
    assert scheduler.get_request("r1").status is RequestStatus.PREEMPTED
    assert scheduler.stats().num_preemptions == 1


def test_an_urgent_arrival_preempts_the_least_urgent_request_for_its_pages():
    scheduler = Scheduler(make_config(scheduling_policy="priority", num_kv_pages=5, max_model_len=16,
                                      enable_prefix_caching=False))
    scheduler.add_request(_request("r0", (1, 2, 3, 4, 5, 6), 1, 0))  # two pages each: the pool is full
    scheduler.add_request(_request("r1", (7, 8, 9, 10, 11, 12), 1, 1))
    assert _step(scheduler) == ["r0", "r1"]
    scheduler.add_request(_request("urgent", (13, 14, 15, 16), -1, 2))
    # The urgent request waits for a page: r1, the least urgent running request (the newest among equals), gives
    # its pages up at once, and r0 decodes on (served after the urgent one, ranked ahead of it, from then on).
    assert [_step(scheduler) for _ in range(2)] == [["r0", "urgent"], ["urgent", "r0"]]
    assert scheduler.stats().num_preemptions == 1 and scheduler.get_request("r1").status is RequestStatus.PREEMPTED


@pytest.mark.parametrize("aging_steps, first_step", [(4, 4), (10**6, 12)])
def test_aging_lets_a_less_urgent_request_past_later_urgent_arrivals(aging_steps, first_step):
    # One sequence at a time; an urgent one-step request arrives at every step 0..11.
    engine = FakeEngine(make_config(scheduling_policy="priority", priority_aging_steps=aging_steps, max_num_seqs=1))
    patient = Work((1, 2, 3), 3, priority=1)
    engine.run([patient] + [Work((k + 4, 5, 6), 1, arrival=k) for k in range(12)])
    started = {}
    for output in engine.outputs:
        for seq in output.sequences:
            started.setdefault(seq.request_id, output.step)
    # Priority 1 against 0: it goes ahead of urgent requests arriving aging_steps steps after it or later.
    assert started["r0"] == first_step
    assert [rid for rid in sorted(started, key=started.get) if rid != "r0"] == [f"r{k + 1}" for k in range(12)]


def _lora_request(request_id: str, lora_id: int, max_tokens: int, arrival: int) -> Request:
    return Request(request_id, (1, 2, 3 + arrival), SamplingParams(max_tokens=max_tokens), arrival, lora_id=lora_id)


def _finish_done(scheduler: Scheduler, ids) -> None:
    """What the engine does after reading a step back: requests with all their tokens are finished."""
    for request_id in ids:
        request = scheduler.get_request(request_id)
        if request is not None and request.num_output_tokens >= request.max_new_tokens:
            scheduler.finish_request(request_id, "length")


def test_requests_behind_one_waiting_for_an_adapter_slot_go_first():
    """One slot, held by adapter 1's long request: adapter 2's request waits for it, and base-model requests and
    adapter 1's requests behind it start at once instead of waiting ~100 steps (head-of-line blocking)."""
    scheduler = Scheduler(make_config(enable_lora=True, max_loras=1, max_model_len=128, num_kv_pages=128))
    scheduler.add_request(_lora_request("long", 1, 100, 0))
    scheduler.add_request(_lora_request("other-adapter", 2, 4, 1))
    scheduler.add_request(_lora_request("base", 0, 2, 2))
    scheduler.add_request(_lora_request("same-adapter", 1, 2, 3))
    assert _step(scheduler) == ["long", "base", "same-adapter"]
    started = {}
    for step in range(1, 200):
        ids = _step(scheduler)
        for request_id in ids:
            started.setdefault(request_id, step)
        _finish_done(scheduler, ids)
        if not scheduler.has_unfinished_requests():
            break
    assert started["other-adapter"] >= 99  # its slot frees when "long" has its 100 tokens
    assert not scheduler.has_unfinished_requests()


def test_a_request_waiting_for_an_adapter_slot_is_passed_over_for_a_bounded_number_of_steps():
    """A stream of adapter-1 requests would keep adapter 1's one slot busy forever; after max_lora_wait_steps nothing
    passes adapter 2's request, the stream's requests drain, and it starts."""
    wait = 5
    scheduler = Scheduler(make_config(enable_lora=True, max_loras=1, max_model_len=128, num_kv_pages=128,
                                      max_lora_wait_steps=wait))
    scheduler.add_request(_lora_request("first", 1, 3, 0))
    scheduler.add_request(_lora_request("other-adapter", 2, 2, 1))
    started = {}
    for step in range(60):
        scheduler.add_request(_lora_request(f"stream-{step}", 1, 3, 2 + step))
        ids = _step(scheduler)
        for request_id in ids:
            started.setdefault(request_id, step)
        _finish_done(scheduler, ids)
    # Passed over while it waited up to the bound; then the stream waits for it, and it starts once the requests
    # that started before the bound have their 3 tokens.
    assert [started[f"stream-{k}"] for k in range(wait)] == list(range(wait))
    assert started[f"stream-{wait}"] > started["other-adapter"] == wait + 2


def test_fcfs_refuses_a_priority_and_changes_nothing():
    scheduler = Scheduler(make_config())
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as refused:
        scheduler.add_request(_request("r", (1, 2), 2, 0))
    assert refused.value.param == "priority" and scheduler.get_request("r") is None
    scheduler.add_request(_request("r", (1, 2), 0, 0))  # 0 asks for nothing
    assert _step(scheduler) == ["r"]


def test_head_of_line_blocking_without_chunked_prefill():
    engine = FakeEngine(make_config(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False))
    workload = [Work((1, 2), 4), Work((3, 4), 4), Work(tuple(range(1, 16)), 1, arrival=1), Work((5,), 2, arrival=1)]
    engine.run(workload)
    first_step = {}
    for output in engine.outputs:
        for seq in output.sequences:
            first_step.setdefault(seq.request_id, output.step)
    assert first_step["r2"] > 1  # two decodes leave 14 tokens of budget: the 15-token prompt waits
    assert first_step["r3"] >= first_step["r2"]  # and the short prompt behind it is not let past


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefix_skips_prefill_and_counts_hits(overlap):
    prefix = tuple(range(1, 21))  # five full pages
    workload = [Work(prefix + (21, 22, 23), 3), Work(prefix + (24, 25, 26), 3, arrival=20),
                Work(prefix + (24, 25, 26), 3, arrival=40, prompt_logprobs=1)]
    cached = FakeEngine(make_config(), overlap)
    uncached = FakeEngine(make_config(enable_prefix_caching=False), overlap)
    assert cached.run(workload) == uncached.run(workload)
    assert uncached.total_batched_tokens - cached.total_batched_tokens == len(prefix)
    stats = cached.scheduler.stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (23 + 23, 20)
    scored = [s for o in cached.outputs for s in o.sequences if s.request_id == "r2"]
    assert scored[0].start_position == 0 and scored[0].wants_prompt_logits
    assert not any(s.wants_prompt_logits for s in scored[1:])  # decode steps score no prompt token
    assert not any(s.wants_prompt_logits for o in cached.outputs for s in o.sequences if s.request_id != "r2")


def test_the_last_prompt_token_is_always_computed():
    prompt = tuple(range(1, 9))  # exactly two pages
    engine = FakeEngine(make_config())
    engine.run([Work(prompt, 2), Work(prompt, 2, arrival=10)])
    repeat = next(s for o in engine.outputs for s in o.sequences if s.request_id == "r1")
    assert (repeat.start_position, repeat.token_ids) == (4, prompt[4:])


@pytest.mark.parametrize("overlap", [False, True])
def test_pages_filled_by_decoding_are_cached(overlap):
    prompt = next(p for p in ((i, 2, 3, 4, 5, 6) for i in range(1, VOCAB)) if EOS not in reference_outputs(p, 8))
    continuation = prompt + tuple(reference_outputs(prompt, 8))  # 14 tokens; its second and third pages hold outputs
    engine = FakeEngine(make_config(), overlap)
    engine.run([Work(prompt, 8), Work(continuation, 1, arrival=30)])
    assert engine.scheduler.stats().prefix_hit_tokens == 12


def test_a_finished_request_keeps_its_first_pages_cached_longest():
    prompt = tuple(range(1, 13))
    engine = FakeEngine(make_config(num_kv_pages=4, max_model_len=16))
    engine.run([Work(prompt, 1), Work((20, 21, 22), 1, arrival=5), Work(prompt, 1, arrival=10)])
    # The unrelated request evicted the finished one's last page, not its first two.
    assert engine.scheduler.stats().prefix_hit_tokens == 8


def test_identical_prompts_share_pages_once_a_step_computed_them():
    engine = FakeEngine(make_config(max_num_batched_tokens=24))
    prompt = tuple(range(1, 13))
    engine.run([Work(prompt, 3), Work(prompt, 3), Work(prompt, 3, arrival=1)])
    first_chunks = {}
    for output in engine.outputs:
        for seq in output.sequences:
            first_chunks.setdefault(seq.request_id, (output.step, seq.start_position))
    # r1 is batched with r0, whose pages are not computed yet; r2 comes a step later and reuses two of them.
    assert first_chunks == {"r0": (0, 0), "r1": (0, 0), "r2": (1, 8)}


def test_overlapped_step_feeds_a_pending_token_on_fresh_pages():
    scheduler = Scheduler(make_config())
    scheduler.add_request(Request("a", (1, 2, 3, 4), SamplingParams(max_tokens=3), 0))
    step0 = scheduler.schedule()
    step1 = scheduler.schedule()
    [decode] = step1.sequences
    assert (decode.token_ids, decode.start_position, decode.samples) == ((PENDING_TOKEN,), 4, True)
    assert len(decode.page_ids) == 2
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    scheduler.update_from_output(step0, {"a": 11})
    assert scheduler.get_request("a").output_token_ids == [11, PENDING_TOKEN]
    scheduler.update_from_output(step1, {"a": 12})
    assert scheduler.get_request("a").output_token_ids == [11, 12]


def test_finishing_with_a_step_in_flight_frees_pages_and_drops_late_results():
    scheduler = Scheduler(make_config())
    scheduler.add_request(Request("a", (1, 2, 3, 4, 5), SamplingParams(max_tokens=3), 0))
    step = scheduler.schedule()
    scheduler.finish_request("a", "stop")
    assert scheduler.pool.num_used == 0 and scheduler.get_request("a") is None
    scheduler.update_from_output(step, {"a": 9})
    scheduler.abort_request("a")
    scheduler.abort_request("never-added")
    assert_pool_drained(scheduler)


@pytest.mark.parametrize("prompt_len,max_tokens,num_pages,param", [
    (0, 1, 64, "prompt"), (48, 1, 64, "prompt"), (40, 9, 64, "max_tokens"),
    (30, 1, 7, "prompt"), (20, 10, 7, "max_tokens"),
])
def test_requests_that_can_never_run_are_refused(prompt_len, max_tokens, num_pages, param):
    engine = FakeEngine(make_config(num_kv_pages=num_pages))
    engine.add("ok-before", Work((1, 2, 3), 2))
    with pytest.raises(InvalidRequestError) as refused:
        engine.add("bad", Work(tuple(range(prompt_len)), max_tokens))
    assert refused.value.param == param
    assert engine.scheduler.get_request("bad") is None
    assert engine.run([Work((4, 5), 2)]) == {"ok-before": reference_outputs((1, 2, 3), 2),
                                             "r0": reference_outputs((4, 5), 2)}


@pytest.mark.parametrize("overrides", [dict(block_size=3), dict(num_kv_pages=1), dict(max_num_seqs=0),
                                       dict(max_num_batched_tokens=32, enable_chunked_prefill=False),
                                       dict(scheduling_policy="lifo"), dict(priority_aging_steps=0)])
def test_invalid_configs_are_refused(overrides):
    with pytest.raises(ConfigError):
        make_config(**overrides)


def test_block_table_width_covers_the_longest_sequence():
    assert make_config(max_model_len=48, block_size=16).max_pages_per_seq == 3
    assert make_config(max_model_len=49, block_size=16).max_pages_per_seq == 4


def test_static_batching_admits_no_request_while_a_batch_runs():
    from jaxserve.engine.request import Request as _Request
    from jaxserve.engine.scheduler import Scheduler as _Scheduler
    from jaxserve.sampling_params import SamplingParams as _Params

    scheduler = _Scheduler(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32, block_size=4,
                                        num_kv_pages=32, static_batching=True))
    for i, max_tokens in enumerate((2, 6, 2)):
        scheduler.add_request(_Request(f"r{i}", [5, 6, 7], _Params(max_tokens=max_tokens), i))
    admitted_late = set()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        running_before = {s.request_id for s in output.sequences if s.start_position > 0}
        started = {s.request_id for s in output.sequences if s.start_position == 0}
        if running_before and started:
            admitted_late |= started
        scheduler.update_from_output(output, {s.request_id: 9 for s in output.sequences if s.samples})
        for s in output.sequences:
            request = scheduler.get_request(s.request_id)
            if request is not None and request.num_output_tokens >= request.max_new_tokens:
                scheduler.finish_request(s.request_id, "length")
    assert not admitted_late
