"""The few padded shapes a step can take, chosen so that every program is compiled once, at start-up."""

from __future__ import annotations

import dataclasses
import itertools

MIN_TOKEN_BUCKET = 16  # smallest padded token count: below it padding costs nothing worth saving


@dataclasses.dataclass(frozen=True)
class StepBucket:
    """One compiled step shape."""

    num_tokens: int  # T: flattened query tokens of the step (decode tokens and prefill chunks)
    num_seqs: int  # S: sequence rows (block tables, sampling rows)
    penalties: bool  # the sampler's penalty part is present
    truncation: bool  # the sampler's top-k/top-p/min-p part is present


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """Powers of two up to the engine's limits: T from MIN_TOKEN_BUCKET to max_num_batched_tokens, S to max_num_seqs."""

    token_sizes: tuple[int, ...]  # ascending; the last is >= max_num_batched_tokens
    seq_sizes: tuple[int, ...]  # ascending; the last is >= max_num_seqs

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int) -> BucketSet:
        return cls(
            token_sizes=_powers_of_two(MIN_TOKEN_BUCKET, max_num_batched_tokens),
            seq_sizes=_powers_of_two(1, max_num_seqs),
        )

    def all_buckets(self) -> list[StepBucket]:
        """Every shape the runner may be asked to run; warm-up compiles each."""
        return [
            StepBucket(t, s, penalties, truncation)
            for t, s, penalties, truncation in itertools.product(
                self.token_sizes, self.seq_sizes, (False, True), (False, True))
            if s <= t
        ]

    def select(self, num_tokens: int, num_seqs: int, penalties: bool, truncation: bool) -> StepBucket:
        """The smallest bucket holding a batch of this size."""
        t = next(size for size in self.token_sizes if size >= num_tokens)
        s = next(size for size in self.seq_sizes if size >= num_seqs)
        return StepBucket(max(t, s), s, penalties, truncation)


def _powers_of_two(smallest: int, limit: int) -> tuple[int, ...]:
    sizes = [smallest]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)
