"""Running a request's prompts through the engine together: one merged stream of (prompt index, event).

Every request of every route passes through `merged_events`, so this is where request metrics are taken: as events
arrive from the engine, before they wait for the client in the exchange's bounded `StreamBuffer` (which merges the
deltas of a client that fell behind), so a slow client does not show up as slow generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from jaxserve.engine.async_engine import EngineEvent
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.errors import JaxserveError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.quotas import TokenTally
from jaxserve.server.stream_buffer import StreamBuffer

if TYPE_CHECKING:
    from jaxserve.server.context import ServerContext

_END = object()  # a prompt's stream ended


async def merged_events(context: ServerContext, prompts: Sequence[TokenizedPrompt], params: SamplingParams,
                        tally: TokenTally, lora: LoRARequest | None = None) -> AsyncIterator[tuple[int, EngineEvent]]:
    """Every prompt's events as they come, tagged with the prompt's index; the first failure ends them all. Generated
    tokens are counted into `tally` (admission's) as they arrive. `lora`: the adapter every prompt runs with.

    Leaving early (the client went away) cancels the per-prompt tasks, which aborts their requests in the engine.
    """
    buffer = StreamBuffer()
    base = uuid.uuid4().hex
    observers = [context.metrics.request_observer(len(p.token_ids), params.n) for p in prompts]
    ended_by = "abort"  # what unfinished continuations count as when the stream ends early: the caller left

    async def pump(index: int, prompt: TokenizedPrompt) -> None:
        try:
            async with contextlib.aclosing(context.engine.generate(f"{base}-{index}", prompt.token_ids, params,
                                                                   prompt=prompt.text, lora_request=lora)) as events:
                async for event in events:
                    observers[index].observe(event)
                    if isinstance(event, CompletionDelta):
                        tally.generated += len(event.token_ids)
                    buffer.put(index, event)
        except Exception as e:
            buffer.put(index, e)
        buffer.put(index, _END)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await buffer.get()
            if event is _END:
                remaining -= 1
            elif isinstance(event, Exception):
                # A refused request never ran; any other failure ended running continuations.
                ended_by = None if isinstance(event, JaxserveError) else "error"
                raise event
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for observer in observers:
            observer.close(ended_by)


async def final_outputs(context: ServerContext, prompts: Sequence[TokenizedPrompt], params: SamplingParams,
                        tally: TokenTally, lora: LoRARequest | None = None) -> list[RequestOutput]:
    """Each prompt's finished RequestOutput, in prompt order."""
    outputs: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(merged_events(context, prompts, params, tally, lora)) as events:
        async for index, event in events:
            if isinstance(event, RequestOutput):
                outputs[index] = event
    return [outputs[i] for i in range(len(prompts))]
