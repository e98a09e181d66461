"""The grammar token masks a step's sampler reads, as a program input of their own: i32[S, ceil(vocab / 32)], bit
t % 32 of word t // 32 set where token t may be drawn. Rows without structured output allow every token, so a step
with no constraint sends nothing: each row count's all-ones masks are put on the devices once and kept."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxserve.schedule import mask_width

ALL_ALLOWED = -1  # a word with all 32 bits set: every token allowed


class StepMasks:
    """Builds a step's masks from the rows that have one, on the host and on the devices."""

    def __init__(self, vocab_size: int, to_devices: Callable[[np.ndarray], jax.Array]):
        self.width = mask_width(vocab_size)  # W: words of a row's mask
        self._to_devices = to_devices  # how the runner puts a host array on its devices
        self._all_allowed: dict[int, jax.Array] = {}  # row count -> i32[S, W] of ALL_ALLOWED, kept on the devices

    def host(self, num_rows: int,
             masks: dict[int, np.ndarray]) -> np.ndarray | None:  # i32[S, W]; None: every row allows every token
        """The step's masks from those of its constrained rows (row -> i32[W])."""
        return self._filled(num_rows, masks) if masks else None

    def whole(self, num_rows: int, host: np.ndarray | None) -> np.ndarray:  # i32[S, W]
        """`host` as an array even where it allows everything (lockstep messages have a fixed shape)."""
        return host if host is not None else np.full((num_rows, self.width), ALL_ALLOWED, np.int32)

    def device(self, num_rows: int, host: np.ndarray | None) -> jax.Array:  # i32[S, W]
        """The masks on the devices; without any, the row count's kept all-ones masks (sent once)."""
        if host is not None:
            return self._to_devices(host)
        if num_rows not in self._all_allowed:
            self._all_allowed[num_rows] = self._to_devices(self.whole(num_rows, None))
        return self._all_allowed[num_rows]

    def _filled(self, num_rows: int, masks: dict[int, np.ndarray]) -> np.ndarray:
        allowed = self.whole(num_rows, None)
        for row, mask in masks.items():
            allowed[row] = mask
        return allowed
