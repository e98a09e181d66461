"""The grammar token masks a step's sampler reads, as a program input of their own: i32[S, ceil(vocab / 32)], bit
t % 32 of word t // 32 set where token t may be drawn. Rows without structured output allow every token, so a step
with no constraint sends nothing: each row count's all-ones masks are put on the devices once and kept. Masks the
grammars filled in place in a whole step's array (FilledMasks) go to the devices as they are, no row copied again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np

from jaxserve.schedule import mask_width

ALL_ALLOWED = -1  # a word with all 32 bits set: every token allowed


def all_allowed(num_rows: int, width: int) -> np.ndarray:  # i32[S, W]
    """Masks that allow every token, `width` words a row: where a step's grammars write their rows."""
    return np.full((num_rows, width), ALL_ALLOWED, np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class FilledMasks(Mapping[int, np.ndarray]):
    """A step's masks as its grammars wrote them, in place in the step's whole array. It reads as the mapping a step
    is given (constrained row -> its i32[W] mask, a view), so any taker of that mapping takes it; StepMasks takes
    the whole array as it is."""

    allowed: np.ndarray  # i32[S, W]: the filled rows' masks, every other row ALL_ALLOWED
    rows: frozenset[int]  # the rows a grammar filled

    def __getitem__(self, row: int) -> np.ndarray:  # i32[W]
        if row not in self.rows:
            raise KeyError(row)
        return self.allowed[row]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.rows))

    def __len__(self) -> int:
        return len(self.rows)


class StepMasks:
    """Builds a step's masks from the rows that have one, on the host and on the devices."""

    def __init__(self, vocab_size: int, to_devices: Callable[[np.ndarray], jax.Array]):
        self.width = mask_width(vocab_size)  # W: words of a row's mask
        self._to_devices = to_devices  # how the runner puts a host array on its devices
        self._all_allowed: dict[int, jax.Array] = {}  # row count -> i32[S, W] of ALL_ALLOWED, kept on the devices

    def host(self, num_rows: int,
             masks: Mapping[int, np.ndarray]) -> np.ndarray | None:  # i32[S, W]; None: every row allows every token
        """The step's masks from those of its constrained rows (row -> i32[W]); FilledMasks of the step's shape are
        that array already."""
        if not masks:
            return None
        if isinstance(masks, FilledMasks) and masks.allowed.shape == (num_rows, self.width):
            return masks.allowed
        return self._filled(num_rows, masks)

    def whole(self, num_rows: int, host: np.ndarray | None) -> np.ndarray:  # i32[S, W]
        """`host` as an array even where it allows everything (lockstep messages have a fixed shape)."""
        return host if host is not None else all_allowed(num_rows, self.width)

    def device(self, num_rows: int, host: np.ndarray | None) -> jax.Array:  # i32[S, W]
        """The masks on the devices; without any, the row count's kept all-ones masks (sent once)."""
        if host is not None:
            return self._to_devices(host)
        if num_rows not in self._all_allowed:
            self._all_allowed[num_rows] = self._to_devices(self.whole(num_rows, None))
        return self._all_allowed[num_rows]

    def _filled(self, num_rows: int, masks: Mapping[int, np.ndarray]) -> np.ndarray:
        allowed = self.whole(num_rows, None)
        for row, mask in masks.items():
            allowed[row] = mask
        return allowed
