"""The few padded shapes a step can take, chosen so that every program is compiled once, at start-up.

Two families instead of the full product of token counts and sequence rows (learned from vLLM, which captures
decode batch sizes 1, 2, 4, 8 and then multiples of 8, and from tpu-inference, which pads tokens to powers of two
and the attention's rows to max_num_seqs only):
  - decode buckets, where every sequence brings one token (T == S), by sequence count: 1, 2, 4, 8, then every
    multiple of 8 up to 64, of 32 up to 256 and of 64 beyond, capped at max_num_seqs. Decode is most of the steps
    of a serving engine, so its padding is kept to at most 8 rows in 64, and 32 in 256;
  - mixed buckets (prefill chunks, with decode tokens or not) by token count: powers of two from MIN_TOKEN_BUCKET
    to FINE_TOKENS_FROM, then also the midpoints (1536, 3072, 6144, ...: padding at most a third rather than a
    half, where a step's tokens cost the most), up to max_num_batched_tokens; each with S = min(T, max_num_seqs)
    rows, enough for any batch of T tokens. Their T tokens dominate the step, so padding rows costs little there.
The sampler's truncation (top-k/top-p/min-p) is a masked no-op where unused, so it costs no step variant; the
sampler of plain steps has one without it (its sort is half of what the sampler moves). Penalties do cost a variant:
they read each row's whole token history, an [S, max_model_len] array sent every step (at 256 rows and a 128k
context, 160 MB), so every shape has a variant with that history and one whose history is one column wide.
Steps that score prompt tokens (prompt_logprobs, evaluation traffic) have their own variant once per token count,
with penalties. With speculative decoding, steps carrying drafts have a verifying variant once per token count
(without penalties or scoring: the scheduler proposes no drafts into such steps). At 64 sequences and 8192 tokens that is 55 programs (21 shapes: 11 decode and 13 mixed, of which 3
coincide, twice each, and 13 scoring); 63 at 256 sequences; the full product with four sampler variants was 276. `benchmarks/padding_waste.py` measures what
the grid costs in padding. A plain bucket (no penalties, scoring or drafts) compiles as a forward program, and its
sampler as two programs per row count, with and without truncation (22 more at 64 sequences:
runner/step_programs.py).
"""

from __future__ import annotations

import dataclasses

MIN_TOKEN_BUCKET = 16  # smallest padded token count of a mixed step: below it padding costs nothing worth saving
FINE_TOKENS_FROM = 1024  # mixed token counts from here on step by half powers of two (multiples of 512 all)


@dataclasses.dataclass(frozen=True)
class StepBucket:
    """One compiled step shape."""

    num_tokens: int  # T: flattened query tokens of the step (decode tokens and prefill chunks)
    num_seqs: int  # S: sequence rows (block tables, sampling rows)
    prompt_logits: bool = False  # every token's next-token log-probabilities are scored too (prompt_logprobs)
    penalties: bool = False  # rows carry their token histories (a row uses a repetition/frequency/presence penalty)
    drafts: bool = False  # rows may bring speculative drafts, verified in the step (never with the two above)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The decode and mixed families for an engine's limits."""

    decode_sizes: tuple[int, ...]  # ascending sequence counts of the decode buckets; the last is max_num_seqs
    token_sizes: tuple[int, ...]  # ascending token counts of the mixed buckets; the last is >= max_num_batched_tokens
    max_num_seqs: int  # most sequence rows of any bucket
    speculative: bool = False  # the mixed family also has a variant verifying drafts (speculative decoding)

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, speculative: bool = False) -> BucketSet:
        return cls(decode_sizes=decode_sizes(max_num_seqs), token_sizes=token_sizes(max_num_batched_tokens),
                   max_num_seqs=max_num_seqs, speculative=speculative)

    @property
    def max_rows(self) -> int:
        """Sequence rows of the widest bucket."""
        return self.max_num_seqs

    def all_buckets(self) -> list[StepBucket]:
        """Every shape the runner may be asked to run; warm-up compiles each (distinct: a mixed bucket of few
        tokens can coincide with a decode bucket)."""
        shapes = [StepBucket(s, s) for s in self.decode_sizes] + [self._mixed(t) for t in self.token_sizes]
        plain = [dataclasses.replace(b, penalties=penalties) for penalties in (False, True) for b in shapes]
        scoring = [self._mixed(t, prompt_logits=True) for t in self.token_sizes]
        verifying = [dataclasses.replace(self._mixed(t), drafts=True) for t in self.token_sizes] if self.speculative \
            else []
        return list(dict.fromkeys(plain + scoring + verifying))

    def select(self, num_tokens: int, num_seqs: int, prompt_logits: bool = False,
               penalties: bool = False, drafts: bool = False) -> StepBucket:
        """The smallest bucket holding a batch of this size: a decode bucket when every sequence brings one token
        (and no prompt is scored), else the mixed (or scoring, or verifying) bucket of its token count; with token
        histories when a row uses a penalty (scoring buckets always carry them). Drafts never share a step with
        penalties or prompt scoring (the scheduler proposes none there)."""
        if drafts:
            if prompt_logits or penalties or not self.speculative:
                raise ValueError("drafts need a speculative bucket set and a step without penalties or prompt scoring")
            return dataclasses.replace(self._mixed(next(t for t in self.token_sizes if t >= num_tokens)), drafts=True)
        if num_tokens == num_seqs and not prompt_logits:
            size = next(s for s in self.decode_sizes if s >= num_seqs)
            return StepBucket(size, size, penalties=penalties)
        return dataclasses.replace(self._mixed(next(t for t in self.token_sizes if t >= num_tokens), prompt_logits),
                                   penalties=penalties or prompt_logits)

    def _mixed(self, num_tokens: int, prompt_logits: bool = False) -> StepBucket:
        return StepBucket(num_tokens, min(num_tokens, self.max_num_seqs), prompt_logits, penalties=prompt_logits)


def decode_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8 to 64, of 32 to 256, of 64 beyond; ending at max_num_seqs exactly."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size += _decode_step(size)
    return (*sizes, max_num_seqs)


def _decode_step(size: int) -> int:
    """The gap after decode size `size`: padding at most 1 row in 8 up to 64, 1 in 3 beyond."""
    if size < 8:
        return size
    return 8 if size < 64 else 32 if size < 256 else 64


def token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from MIN_TOKEN_BUCKET, with the midpoints from FINE_TOKENS_FROM on, until one holds the limit.

    Every size is a power of two or 1.5 times one of at least 1024: a multiple of the prompt scorer's 128-row tile.
    """
    sizes = [MIN_TOKEN_BUCKET]
    while sizes[-1] < max_num_batched_tokens:
        power = 1 << (sizes[-1].bit_length() - 1)  # the power of two at or below the last size
        midpoint = power + power // 2
        sizes.append(midpoint if power >= FINE_TOKENS_FROM and sizes[-1] == power else 2 * power)
    return tuple(sizes)
