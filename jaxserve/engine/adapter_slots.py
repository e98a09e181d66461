"""`AdapterSlots`: which LoRA adapter each device slot holds, and how many running requests use it.

The device has `max_loras` adapter slots (model/lora.py; slot 0 is the base model's). A running request holds its
adapter's slot; a slot no running request uses stays filled, so an adapter that comes back soon needs no new write,
until an adapter without a slot needs it: the least recently used idle slot is taken (empty ones first). When every
slot is in use by running requests, a request of yet another adapter waits (`acquire` answers None).
"""

from __future__ import annotations

import collections


class AdapterSlots:
    """Slot bookkeeping on the host; writing a slot's weights is the runner's (ModelRunner.write_lora_slot)."""

    def __init__(self, max_loras: int):
        self._max_loras = max_loras
        self.reset()

    def can_acquire(self, lora_id: int) -> bool:
        """Whether a request of this adapter (0: none) could start running now."""
        return lora_id == 0 or lora_id in self._slot_of or bool(self._idle)

    def acquire(self, lora_id: int) -> tuple[int, bool]:
        """The slot a starting request of `lora_id` uses, and whether the adapter must be written into it first.

        Raises when no slot is free: callers check `can_acquire`."""
        if lora_id == 0:
            return 0, False
        slot = self._slot_of.get(lora_id)
        fresh = slot is None
        if fresh:
            if not self._idle:
                raise RuntimeError(f"no LoRA slot is free for adapter {lora_id}")
            slot = next(iter(self._idle))
            self._evict(slot)
            self._holder[slot], self._slot_of[lora_id] = lora_id, slot
        self._idle.pop(slot, None)
        self._users[slot] += 1
        return slot, fresh

    def release(self, slot: int) -> None:
        """A request stopped running on `slot` (finished, aborted or preempted)."""
        if slot == 0:
            return
        self._users[slot] -= 1
        if self._users[slot] == 0:
            del self._users[slot]
            self._idle[slot] = None  # most recently used idle slot: taken last...
            if slot not in self._holder:
                self._idle.move_to_end(slot, last=False)  # ...unless it holds nothing (forgotten): taken first

    def forget(self, lora_id: int) -> None:
        """The adapter was unloaded: its slot, once idle, is taken first, and a later load is written afresh."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            return
        self._evict(slot)
        if slot in self._idle:
            self._idle.move_to_end(slot, last=False)

    def reset(self) -> None:
        """Every slot empty and unused (at the start, and after a failed step aborted every request): later
        adapters are written afresh, whatever a failed write left in a slot."""
        self._holder: dict[int, int] = {}  # slot -> adapter id it holds
        self._slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._users: collections.Counter[int] = collections.Counter()  # slot -> running requests using it
        # Slots no running request uses, least recently used first; empty slots come first of all.
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(1, self._max_loras + 1))

    def _evict(self, slot: int) -> None:
        lora_id = self._holder.pop(slot, None)
        if lora_id is not None:
            del self._slot_of[lora_id]
