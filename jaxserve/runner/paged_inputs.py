"""Host-side construction of a step's paged-attention inputs from the scheduled chunks, in plain numpy.

The scheduler hands the runner, per sequence (`ScheduledSequence`), where this step's chunk starts, how many tokens
it has and the sequence's pages; `build_metadata` turns that into the fixed-shape arrays of `PagedAttentionMetadata`
(padded to the step's buckets) and the token positions, ready for one `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from jaxserve.model.paged_kv_cache import PADDING_SLOT, PagedAttentionMetadata
from jaxserve.schedule import NULL_PAGE, ScheduledSequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """What one step needs besides the token ids, as host arrays of the step's bucket shapes."""

    positions: np.ndarray  # i32[T]: each token's position in its sequence; 0 for padding
    metadata: PagedAttentionMetadata  # numpy leaves: slot_mapping i32[T], token_seq i32[T], block_tables, seq_lens


def build_metadata(chunks: Sequence[ScheduledSequence], *, num_tokens: int, num_seqs: int, max_pages: int,
                   page_size: int, block_tables: np.ndarray | None = None,
                   layout: ChunkLayout | None = None) -> PagedInputs:
    """Flatten the chunks (in order) into T = num_tokens tokens over S = num_seqs sequence rows.

    Row i holds chunks[i]; the remaining rows are padding (length 0, null pages). Padding tokens after the real
    ones never write (their slot is dropped) and point at the first padding row, or at the last row when none is
    spare, so a full bucket of sequences needs no extra row. Whole-array numpy: the host's cost per step must stay
    well under a millisecond at hundreds of sequences. `block_tables` (i32[num_seqs, max_pages]), where given, are
    the chunks' block tables already laid out and checked for the null page (runner/input_rows.py keeps them between
    steps); `layout`, where given, is `ChunkLayout.of(chunks)` already computed.
    """
    layout = layout if layout is not None else ChunkLayout.of(chunks)
    _check_fits(layout, num_tokens, num_seqs, max_pages, page_size)
    n, total = len(chunks), layout.num_tokens
    if block_tables is None:
        block_tables = _block_tables(chunks, layout.num_pages, num_seqs, max_pages)
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = layout.positions
    slot_mapping = np.full(num_tokens, PADDING_SLOT, np.int32)
    pages_of_tokens = block_tables[layout.token_rows, layout.positions // page_size]  # i32[total]
    slot_mapping[:total] = pages_of_tokens * page_size + layout.positions % page_size
    # Padding tokens read the first padding row (length 0: zero output); with no spare row, the last real row, where
    # at position 0 they read one cached slot: finite, and their outputs are never used.
    token_seq = np.full(num_tokens, min(n, num_seqs - 1), np.int32)
    token_seq[:total] = layout.token_rows
    seq_lens = np.zeros(num_seqs, np.int32)
    seq_lens[:n] = layout.starts + layout.counts
    metadata = PagedAttentionMetadata(slot_mapping=slot_mapping, token_seq=token_seq, block_tables=block_tables,
                                      seq_lens=seq_lens)
    return PagedInputs(positions=positions, metadata=metadata)


def _block_tables(chunks: Sequence[ScheduledSequence], page_counts: np.ndarray, num_seqs: int,
                  max_pages: int) -> np.ndarray:
    """i32[num_seqs, max_pages]: row i holds chunks[i]'s pages (page_counts i32[n] of them), then null pages."""
    n = len(chunks)
    block_tables = np.full((num_seqs, max_pages), NULL_PAGE, np.int32)
    page_rows = np.repeat(np.arange(n, dtype=np.int32), page_counts)
    page_cols = np.arange(page_counts.sum(), dtype=np.int32) - np.repeat(np.cumsum(page_counts) - page_counts,
                                                                         page_counts)
    pages = np.fromiter(itertools.chain.from_iterable(c.page_ids for c in chunks), np.int32, int(page_counts.sum()))
    check_no_null_page(pages)
    block_tables[page_rows, page_cols] = pages
    return block_tables


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk's tokens sit in the flattened batch (host arrays over the n real chunks)."""

    starts: np.ndarray  # i32[n]: position of each chunk's first token in its sequence
    counts: np.ndarray  # i32[n]: tokens per chunk
    num_pages: np.ndarray  # i32[n]: pages each chunk's sequence holds (the length of its block table)
    first_token: np.ndarray  # i32[n]: index of each chunk's first token in the batch
    token_rows: np.ndarray  # i32[total]: the chunk (row) of every real token
    positions: np.ndarray  # i32[total]: every real token's position in its sequence

    @classmethod
    def of(cls, chunks: Sequence[ScheduledSequence]) -> ChunkLayout:
        n = len(chunks)
        starts = np.fromiter((c.start_position for c in chunks), np.int32, n)
        counts = np.fromiter((c.num_tokens for c in chunks), np.int32, n)
        num_pages = np.fromiter((len(c.page_ids) for c in chunks), np.int32, n)
        if (counts == 1).all():  # a decode step: chunk i is token i
            rows = np.arange(n, dtype=np.int32)
            return cls(starts, counts, num_pages, rows, rows, starts)
        first_token = (np.cumsum(counts) - counts).astype(np.int32)
        token_rows = np.repeat(np.arange(n, dtype=np.int32), counts)
        offsets = np.arange(counts.sum(), dtype=np.int32) - first_token[token_rows]  # i32[total]: index in chunk
        return cls(starts, counts, num_pages, first_token, token_rows, starts[token_rows] + offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def last_token(self) -> np.ndarray:  # i32[n]: index of each chunk's last token in the batch
        return self.first_token + self.counts - 1


def _check_fits(layout: ChunkLayout, num_tokens: int, num_seqs: int, max_pages: int, page_size: int) -> None:
    total, n, held = layout.num_tokens, len(layout.counts), layout.num_pages
    if total > num_tokens or n > num_seqs:
        raise ValueError(f"{n} sequences with {total} tokens do not fit buckets of "
                         f"{num_seqs} sequences and {num_tokens} tokens")
    needed = -(-(layout.starts + layout.counts) // page_size)  # i32[n]
    bad = np.flatnonzero((held < needed) | (held > max_pages))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"a sequence of {int(layout.starts[i] + layout.counts[i])} tokens needs {int(needed[i])} "
                         f"pages; it has {int(held[i])} and a block table holds {max_pages}")


def check_no_null_page(page_ids: Sequence[int] | np.ndarray) -> None:
    """Refuses page ids sequences hold (a block table's tuple, or i32[...]) that name the null page."""
    if NULL_PAGE in page_ids:
        raise ValueError("page 0 is the null page and cannot belong to a sequence")
