"""Where an engine step's wall time goes on the host, summed over steps: the figure that tells a host-bound step
from a device-bound one (with async overlap the host's work hides the device's, and only the wait shows)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator


@dataclasses.dataclass
class StepPhaseTimes:
    """Seconds the host spent in each phase of `LLMEngine.step`, summed since the engine started."""

    steps: int = 0  # LLMEngine.step calls
    schedule_s: float = 0.0  # Scheduler.schedule: choosing the batch and its pages
    dispatch_s: float = 0.0  # the runner's input preparation, host-to-device transfer and program launch
    masks_s: float = 0.0  # grammar masks of the step's constrained draws (structured output)
    wait_s: float = 0.0  # blocked reading a step's samples back: device time the host's work did not hide
    outputs_s: float = 0.0  # samples into the scheduler and into each request's output (detokenizing included)

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Adds the block's wall time to the phase named `phase` (`schedule`, `dispatch`, `masks`, `wait` or
        `outputs`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            field = f"{phase}_s"
            setattr(self, field, getattr(self, field) + time.perf_counter() - started)

    def since(self, earlier: StepPhaseTimes) -> StepPhaseTimes:
        """The phases' time between `earlier` (a copy taken then) and now."""
        return StepPhaseTimes(**{field.name: getattr(self, field.name) - getattr(earlier, field.name)
                                 for field in dataclasses.fields(self)})

    def per_step_ms(self) -> dict[str, float]:
        """Each phase's milliseconds per step."""
        return {field.name.removesuffix("_s"): 1e3 * getattr(self, field.name) / max(self.steps, 1)
                for field in dataclasses.fields(self) if field.name != "steps"}
