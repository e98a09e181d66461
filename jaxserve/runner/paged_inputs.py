"""Host-side construction of a step's paged-attention inputs from the scheduled chunks, in plain numpy.

The scheduler hands the runner, per sequence, where this step's chunk starts, how many tokens it has and the
sequence's pages; `build_metadata` turns that into the fixed-shape arrays of `PagedAttentionMetadata` (padded to the
step's buckets) and the token positions, ready for one `jax.device_put`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from jaxserve.model.paged_kv_cache import NULL_PAGE, PADDING_SLOT, PagedAttentionMetadata


class ScheduledChunk(Protocol):
    """One sequence's share of a step: tokens start_position .. start_position + num_tokens - 1.

    The scheduler's `ScheduledSequence` has this shape, so its output can be passed as it is.
    """

    @property
    def start_position(self) -> int: ...  # tokens of this sequence already in the cache (earlier chunks)

    @property
    def num_tokens(self) -> int: ...  # tokens computed this step: a prefill chunk, or 1 for a decode

    @property
    def page_ids(self) -> Sequence[int]: ...  # the sequence's pages in order, covering start_position + num_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """What one step needs besides the token ids, as host arrays of the step's bucket shapes."""

    positions: np.ndarray  # i32[T]: each token's position in its sequence; 0 for padding
    metadata: PagedAttentionMetadata  # numpy leaves: slot_mapping i32[T], token_seq i32[T], block_tables, seq_lens


def build_metadata(chunks: Sequence[ScheduledChunk], *, num_tokens: int, num_seqs: int, max_pages: int,
                   page_size: int) -> PagedInputs:
    """Flatten the chunks (in order) into T = num_tokens tokens over S = num_seqs sequence rows.

    Row i holds chunks[i]; the remaining rows are padding (length 0, null pages). Padding tokens after the real
    ones never write (their slot is dropped) and point at the first padding row, or at the last row when none is
    spare, so a full bucket of sequences needs no extra row.
    """
    _check_fits(chunks, num_tokens, num_seqs, max_pages, page_size)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, PADDING_SLOT, np.int32)
    # Padding tokens read the first padding row (length 0: zero output); with no spare row, the last real row, where
    # at position 0 they read one cached slot: finite, and their outputs are never used.
    token_seq = np.full(num_tokens, min(len(chunks), num_seqs - 1), np.int32)
    block_tables = np.full((num_seqs, max_pages), NULL_PAGE, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    first = 0  # index of the chunk's first token in the flattened batch
    for row, chunk in enumerate(chunks):
        pages = np.asarray(chunk.page_ids, np.int32)  # i32[pages of this sequence]
        chunk_positions = np.arange(chunk.start_position, chunk.start_position + chunk.num_tokens, dtype=np.int32)
        tokens = slice(first, first + chunk.num_tokens)
        positions[tokens] = chunk_positions
        slot_mapping[tokens] = pages[chunk_positions // page_size] * page_size + chunk_positions % page_size
        token_seq[tokens] = row
        block_tables[row, : len(pages)] = pages
        seq_lens[row] = chunk.start_position + chunk.num_tokens
        first += chunk.num_tokens
    metadata = PagedAttentionMetadata(slot_mapping=slot_mapping, token_seq=token_seq, block_tables=block_tables,
                                      seq_lens=seq_lens)
    return PagedInputs(positions=positions, metadata=metadata)


def _check_fits(chunks: Sequence[ScheduledChunk], num_tokens: int, num_seqs: int, max_pages: int,
                page_size: int) -> None:
    total = sum(chunk.num_tokens for chunk in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{len(chunks)} sequences with {total} tokens do not fit buckets of "
                         f"{num_seqs} sequences and {num_tokens} tokens")
    for chunk in chunks:
        needed = -(-(chunk.start_position + chunk.num_tokens) // page_size)
        if not needed <= len(chunk.page_ids) <= max_pages:
            raise ValueError(f"a sequence of {chunk.start_position + chunk.num_tokens} tokens needs {needed} pages; "
                             f"it has {len(chunk.page_ids)} and a block table holds {max_pages}")
        if NULL_PAGE in chunk.page_ids:
            raise ValueError("page 0 is the null page and cannot belong to a sequence")
