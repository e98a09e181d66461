"""`StreamBuffer`: one HTTP exchange's engine events waiting for its client, bounded, never a reason to wait.

Nothing upstream of this buffer waits for a client: the engine thread hands each step's events to the event loop with
`call_soon_threadsafe` (AsyncEngine), and the exchange's pump tasks (streams.py) move them here at once. Only the HTTP
send waits, when the client reads slower than the model writes, and then events pile up here with every step.

Past `MAX_PENDING_EVENTS` waiting events, a new delta is merged into the delta its continuation already has waiting
(text, token ids and logprobs concatenate; the finish reason is the newer one's), as vLLM's RequestOutputCollector
merges outputs for a consumer that fell behind. So memory stays bounded by the request's own output, which its final
RequestOutput holds anyway; generation goes on at full speed for everyone; and a client that catches up gets its
backlog in a few large chunks. Below the bound nothing merges: a client that keeps up sees one chunk per step.

Dropping the client when the buffer overflows would be the other choice: it would punish a brief stall (a collection
pause, a busy network) as hard as a dead client. How long a client may stall is --stream-timeout's question instead
(slow_clients.py), which looks at the send itself.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

from jaxserve.outputs import CompletionDelta

MAX_PENDING_EVENTS = 64  # events kept one by one before deltas start merging; a client this far behind is stalled


class StreamBuffer:
    """(prompt index, event) pairs in arrival order for one reader; `put` never waits.

    At most `limit` events plus a few per sequence wait at once: past the limit a delta merges into its
    continuation's waiting delta, and only a continuation's first waiting delta, a prompt's final output, a failure
    or a stream's end are added beyond it.
    """

    def __init__(self, limit: int = MAX_PENDING_EVENTS):
        self._limit = limit  # waiting events before deltas merge
        self._cells: collections.deque[list] = collections.deque()  # [prompt index, event] cells, oldest first
        # (prompt index, continuation index) -> the cell of that continuation's newest waiting delta
        self._newest_delta: dict[tuple[int, int], list] = {}
        self._nonempty = asyncio.Event()  # set while a cell waits

    def __len__(self) -> int:
        return len(self._cells)

    def put(self, index: int, event: Any) -> None:
        """Adds prompt `index`'s event (a delta, a final output, an exception or an end marker)."""
        key = (index, event.index) if isinstance(event, CompletionDelta) else None
        waiting = self._newest_delta.get(key) if key is not None else None
        if waiting is not None and len(self._cells) >= self._limit:
            waiting[1] = merged_deltas(waiting[1], event)
            return
        cell = [index, event]
        self._cells.append(cell)
        if key is not None:
            self._newest_delta[key] = cell
        self._nonempty.set()

    async def get(self) -> tuple[int, Any]:
        """The oldest waiting pair, once there is one."""
        await self._nonempty.wait()
        cell = self._cells.popleft()
        if not self._cells:
            self._nonempty.clear()
        index, event = cell
        if isinstance(event, CompletionDelta) and self._newest_delta.get((index, event.index)) is cell:
            del self._newest_delta[(index, event.index)]
        return index, event


def merged_deltas(older: CompletionDelta, newer: CompletionDelta) -> CompletionDelta:
    """One delta saying what `older` and then `newer` said, for the same continuation (the prompt's logprobs come
    with the first)."""
    logprobs = None if older.logprobs is None else older.logprobs + newer.logprobs
    return dataclasses.replace(older, text=older.text + newer.text, token_ids=older.token_ids + newer.token_ids,
                               logprobs=logprobs, finish_reason=newer.finish_reason, stop_reason=newer.stop_reason)
