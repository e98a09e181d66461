"""InputRows (block tables and sampling settings kept between steps) against the reference builders, step by step."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.runner.input_rows import InputRows
from jaxserve.runner.sampler import build_sampling_tensors
from jaxserve.schedule import NULL_PAGE, SamplingRow, ScheduledSequence

CAPACITY, MAX_PAGES, BIAS, STOPS, VOCAB = 6, 8, 4, 4, 64
EOS = (1, 2)


def _params(rng: np.random.Generator) -> SamplingParams:
    choices = [
        dict(temperature=0),
        dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(0, 5)), top_p=0.9, min_p=0.05),
        dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=int(rng.integers(0, 4))),
        dict(temperature=0, logit_bias={int(rng.integers(0, VOCAB)): 2.0}, stop_token_ids=[5, 6], ignore_eos=True),
    ]
    return SamplingParams(**choices[int(rng.integers(len(choices)))])


class _Sequence:
    """A request as the runner sees it across steps: pages that grow, shrink and change, outputs that grow."""

    def __init__(self, name: str, rng: np.random.Generator, free_pages: list[int]):
        self.name, self.params, self.seed = name, _params(rng), int(rng.integers(2**40))
        self.prompt = tuple(int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 6))))
        self.outputs: list[int] = []
        self.pages = [free_pages.pop() for _ in range(int(rng.integers(1, 3)))]

    def chunk(self) -> ScheduledSequence:
        row = SamplingRow(self.params, self.prompt, self.outputs, EOS, seed=self.seed, step=len(self.outputs))
        return ScheduledSequence(self.name, (7,), len(self.prompt) + len(self.outputs), tuple(self.pages),
                                 samples=True, wants_prompt_logits=False, sampling=row)


def _step(rng, live, free_pages, counter):
    """Changes the live sequences as steps do: new ones, finished or preempted ones, pages gained or rolled back."""
    for seq in list(live):
        event = rng.random()
        if event < 0.1:  # finished or preempted: its pages go back and it leaves the step
            live.remove(seq)
            free_pages.extend(seq.pages)
        elif event < 0.3 and len(seq.pages) < MAX_PAGES and free_pages:
            seq.pages.append(free_pages.pop(int(rng.integers(len(free_pages)))))
        elif event < 0.4 and len(seq.pages) > 1:  # rolled-back drafts give a page back
            free_pages.append(seq.pages.pop())
        seq.outputs.append(int(rng.integers(0, VOCAB)))
    while len(live) < CAPACITY and free_pages and rng.random() < 0.6:
        live.append(_Sequence(f"r{next(counter)}", rng, free_pages))


def _plain_block_tables(chunks, num_rows) -> np.ndarray:
    """The reference: each chunk's pages in its row, null pages after them and in the padding rows."""
    table = np.full((num_rows, MAX_PAGES), NULL_PAGE, np.int32)
    for row, chunk in enumerate(chunks):
        table[row, :len(chunk.page_ids)] = chunk.page_ids
    return table


@pytest.mark.parametrize("seed", range(3))
def test_kept_rows_build_what_the_reference_builds(seed):
    import itertools

    rng = np.random.default_rng(seed)
    rows = InputRows(CAPACITY, MAX_PAGES, BIAS, STOPS)
    free_pages = list(range(1, 40))
    rng.shuffle(free_pages)
    live, counter = [], itertools.count()
    for _ in range(60):
        _step(rng, live, free_pages, counter)
        present = [s for s in live if rng.random() < 0.9]  # a running request may sit a step out
        chunks = [s.chunk() for s in present]
        num_rows = CAPACITY + int(rng.integers(0, 3))
        history = 64 if any(c.sampling.params.uses_penalties for c in chunks) else 1
        page_counts = np.array([len(c.page_ids) for c in chunks], np.int32)
        slots = rows.slots(chunks, page_counts)
        np.testing.assert_array_equal(rows.block_table_rows(slots, num_rows), _plain_block_tables(chunks, num_rows))
        assert rows.any_penalties(slots) == any(c.sampling.params.uses_penalties for c in chunks)
        kept = rows.sampling_tensors(chunks, slots, num_rows, history)
        built = dataclasses.replace(build_sampling_tensors([c.sampling for c in chunks], num_rows, bias_width=BIAS,
                                                           stop_width=STOPS, history_width=history), allowed=None)
        jax.tree.map(np.testing.assert_array_equal, kept, built)


def test_a_block_table_naming_the_null_page_is_refused_and_not_kept():
    rows = InputRows(CAPACITY, MAX_PAGES, BIAS, STOPS)
    row = SamplingRow(SamplingParams(temperature=0), (3,), [], EOS, seed=0)
    bad = ScheduledSequence("a", (7,), 1, (4, 0), samples=True, wants_prompt_logits=False, sampling=row)
    with pytest.raises(ValueError, match="null page"):
        rows.slots([bad], np.array([2], np.int32))
    good = dataclasses.replace(bad, page_ids=(4, 5))
    slots = rows.slots([good], np.array([2], np.int32))
    np.testing.assert_array_equal(rows.block_table_rows(slots, 1)[0, :3], [4, 5, 0])
