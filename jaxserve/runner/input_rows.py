"""`InputRows`: the per-sequence step inputs that rarely change, kept between steps so the host rewrites only changes.

A decoding sequence brings the same block table (until it crosses a page boundary) and the same sampling settings
step after step; rebuilding them from Python objects for hundreds of sequences costs the host more than a
millisecond per step. Each sequence of a step holds a slot here while it keeps appearing in steps: its block table
row and its sampling settings are written when it takes the slot, the block table again only where its pages
changed (found by whole-batch comparisons), and a step gathers its rows by slot in one indexing per array. A
sequence missing from a step gives its slot back (finished, preempted or waiting), so slots never outnumber a step's
rows.

The settings of a slot are written by `build_sampling_tensors` for that one row, and the dynamic parts (step, the
min_tokens block, penalty histories) by the same helpers the reference path uses, so both paths follow one set of
rules; `tests/test_input_rows.py` checks that they build identical arrays. Grammar masks are not built here: the
runner sends them on their own, once the engine has filled them (ModelRunner.finish).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.runner.paged_inputs import check_no_null_page
from jaxserve.runner.sampler import (PenaltyTensors, SamplingTensors, TruncationTensors, blocks_stop_ids,
                                     build_sampling_tensors, penalty_tensors)
from jaxserve.schedule import NULL_PAGE, SamplingRow, ScheduledSequence

class InputRows:
    """Slots of block tables and sampling settings for up to `capacity` sequences, plus one padding slot."""

    def __init__(self, capacity: int, max_pages: int, bias_width: int, stop_width: int):
        self._bias_width, self._stop_width = bias_width, stop_width
        self.padding_slot = capacity  # neutral settings and null pages: rows past a step's sequences read it
        self._free = list(range(capacity - 1, -1, -1))
        self._slot_of: dict[str, int] = {}  # request id -> its slot
        self._owner: list[tuple | None] = [None] * (capacity + 1)  # (params, seed) each slot's settings came from
        self.block_tables = np.full((capacity + 1, max_pages), NULL_PAGE, np.int32)  # i32[C + 1, max_pages]
        self.num_pages = np.zeros(capacity + 1, np.int32)  # i32[C + 1]: pages written in each row
        self.min_tokens = np.zeros(capacity + 1, np.int32)  # i32[C + 1]: EOS/stop ids masked below this many outputs
        self.uses_penalties = np.zeros(capacity + 1, np.bool_)  # bool[C + 1]: the slot's params apply a penalty
        self._settings = _neutral_settings(capacity + 1, bias_width, stop_width)  # leaves [C + 1, ...]

    def slots(self, chunks: Sequence[ScheduledSequence], num_pages: np.ndarray) -> np.ndarray:  # i32[n]
        """Each chunk's slot, its rows brought up to date; slots of sequences absent from this step are freed.
        `num_pages` (i32[n]): the length of each chunk's block table (ChunkLayout.num_pages)."""
        slots = np.fromiter((self._slot_of.get(c.request_id, -1) for c in chunks), np.int32, len(chunks))
        new_rows = np.flatnonzero(slots < 0).tolist()
        # Every slot held by a chunk of this step (the steady state) means no sequence has left.
        if new_rows or len(self._slot_of) != len(chunks):
            present = {c.request_id for c in chunks}
            for request_id in self._slot_of.keys() - present:
                self._free.append(self._slot_of.pop(request_id))
        for row in new_rows:
            slots[row] = self._slot_of[chunks[row].request_id] = slot = self._free.pop()
            # Another sequence's pages may end like this one's: its block table is written whole.
            self.num_pages[slot] = -1
        self._refresh_settings(chunks, slots)
        self._refresh_block_tables(chunks, slots, num_pages)
        return slots

    def any_penalties(self, slots: np.ndarray) -> bool:
        """Whether a penalty applies to a row of these slots (i32[n]): the step needs its penalties variant."""
        return bool(self.uses_penalties[slots].any())

    def block_table_rows(self, slots: np.ndarray, num_rows: int) -> np.ndarray:  # i32[num_rows, max_pages]
        return self.block_tables[self._padded(slots, num_rows)]

    def sampling_tensors(self, chunks: Sequence[ScheduledSequence], slots: np.ndarray, num_rows: int,
                         history_width: int) -> SamplingTensors:
        """What `build_sampling_tensors` builds for these chunks' rows padded to num_rows, from the slots, but the
        token masks (allowed: None)."""
        rows = [c.sampling for c in chunks]
        padded = self._padded(slots, num_rows)
        kept = {name: leaf[padded] for name, leaf in self._settings.items()}
        steps = np.zeros(num_rows, np.int32)
        steps[:len(rows)] = np.fromiter((r.draw_step for r in rows), np.int32, len(rows))
        histories = penalty_tensors(rows, num_rows, history_width) if history_width > 1 else None
        return SamplingTensors(
            greedy=kept["greedy"], temperature=kept["temperature"], seeds=kept["seeds"], steps=steps,
            bias_ids=kept["bias_ids"], bias_values=kept["bias_values"], stop_ids=kept["stop_ids"],
            block_stop_ids=blocks_stop_ids(steps, self.min_tokens[padded]),
            allowed=None,
            penalties=PenaltyTensors(
                history_ids=histories.history_ids if histories else np.full((num_rows, 1), -1, np.int32),
                history_is_output=histories.history_is_output if histories else np.zeros((num_rows, 1), np.bool_),
                repetition=kept["repetition"], frequency=kept["frequency"], presence=kept["presence"]),
            truncation=TruncationTensors(top_k=kept["top_k"], top_p=kept["top_p"], min_p=kept["min_p"]),
        )

    def _padded(self, slots: np.ndarray, num_rows: int) -> np.ndarray:  # i32[num_rows]
        padded = np.full(num_rows, self.padding_slot, np.int32)
        padded[:len(slots)] = slots
        return padded

    def _refresh_settings(self, chunks: Sequence[ScheduledSequence], slots: np.ndarray) -> None:
        """Writes the settings of slots whose sequence is new to them (by its params object and seed)."""
        for chunk, slot in zip(chunks, slots.tolist()):
            owner = self._owner[slot]
            row = chunk.sampling
            if owner is None or owner[0] is not row.params or owner[1] != row.seed:
                self._write_settings(slot, row)

    def _write_settings(self, slot: int, row: SamplingRow) -> None:
        one = build_sampling_tensors([dataclasses.replace(row, token_mask=None, output_ids=(), prompt_ids=())], 1,
                                     bias_width=self._bias_width, stop_width=self._stop_width, history_width=1,
                                     mask_width=1)
        for name, leaf in _flat_settings(one).items():
            self._settings[name][slot] = leaf[0]
        self.min_tokens[slot] = row.params.min_tokens
        self.uses_penalties[slot] = row.params.uses_penalties
        self._owner[slot] = (row.params, row.seed)

    def _refresh_block_tables(self, chunks: Sequence[ScheduledSequence], slots: np.ndarray,
                              counts: np.ndarray) -> None:
        """Rewrites the rows whose page count (counts i32[n]) or last page differs from what the row holds, each
        checked for the null page as it is written."""
        last = np.fromiter((c.page_ids[-1] if c.page_ids else NULL_PAGE for c in chunks), np.int32, len(chunks))
        held = self.num_pages[slots]
        stored_last = self.block_tables[slots, np.maximum(counts - 1, 0)]
        changed = (counts != held) | (stored_last != np.where(counts > 0, last, stored_last))
        # Row by row: about 16 rows change per step at 256 sequences, and numpy copies a tuple into a row faster
        # than a whole-array scatter gathers them (measured 32 against 47 us).
        for row in np.flatnonzero(changed).tolist():
            slot, pages = int(slots[row]), chunks[row].page_ids
            check_no_null_page(pages)
            self.block_tables[slot, :len(pages)] = pages
            self.block_tables[slot, len(pages):] = NULL_PAGE
            self.num_pages[slot] = len(pages)


def _flat_settings(tensors: SamplingTensors) -> dict[str, np.ndarray]:
    """The kept settings of SamplingTensors by name (penalty scalars and truncation flattened in)."""
    return {"greedy": tensors.greedy, "temperature": tensors.temperature, "seeds": tensors.seeds,
            "bias_ids": tensors.bias_ids, "bias_values": tensors.bias_values, "stop_ids": tensors.stop_ids,
            "repetition": tensors.penalties.repetition, "frequency": tensors.penalties.frequency,
            "presence": tensors.penalties.presence, "top_k": tensors.truncation.top_k,
            "top_p": tensors.truncation.top_p, "min_p": tensors.truncation.min_p}


def _neutral_settings(num_slots: int, bias_width: int, stop_width: int) -> dict[str, np.ndarray]:
    """Every slot's settings as padding rows have them (greedy, no bias, no stops, no penalty or truncation)."""
    empty = build_sampling_tensors([], num_slots, bias_width=bias_width, stop_width=stop_width, history_width=1,
                                   mask_width=1)
    return {name: np.array(leaf) for name, leaf in _flat_settings(empty).items()}
