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
    prompt_logits: bool = False  # every token's next-token log-probabilities are scored too (prompt_logprobs)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """Powers of two up to the engine's limits: T from MIN_TOKEN_BUCKET to max_num_batched_tokens, S to max_num_seqs.

    Steps that score prompt tokens are rare (evaluation traffic) and dominated by their T × vocab logits, so their
    variant exists once per token count only: at the largest sequence-row count and with the whole sampler, which
    serve any mix of chunks and sampling settings (absent sampler parts are neutral settings). That adds one program
    per token count to the start-up compiles rather than one per shape and sampler variant.
    """

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
        sampling = [
            StepBucket(t, s, penalties, truncation)
            for t, s, penalties, truncation in itertools.product(
                self.token_sizes, self.seq_sizes, (False, True), (False, True))
            if s <= t
        ]
        scoring = dict.fromkeys(  # distinct: small token counts may all round up to the sequence-row count
            self.select(t, 1, penalties=True, truncation=True, prompt_logits=True) for t in self.token_sizes)
        return sampling + list(scoring)

    def select(self, num_tokens: int, num_seqs: int, penalties: bool, truncation: bool,
               prompt_logits: bool = False) -> StepBucket:
        """The smallest bucket holding a batch of this size (for prompt scoring: the one variant of its token count)."""
        t = next(size for size in self.token_sizes if size >= num_tokens)
        if prompt_logits:
            s = self.seq_sizes[-1]
            return StepBucket(max(t, s), s, penalties=True, truncation=True, prompt_logits=True)
        s = next(size for size in self.seq_sizes if size >= num_seqs)
        return StepBucket(max(t, s), s, penalties, truncation)


def _powers_of_two(smallest: int, limit: int) -> tuple[int, ...]:
    sizes = [smallest]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)
