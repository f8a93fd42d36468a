"""What the engine keeps about its steps: the one in flight, and a record of what each computed."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.runner.model_runner import PendingStep, StepResult


@dataclass
class InFlightStep:
    """A dispatched step: what was scheduled, and its device outputs (PendingStep) or, once read, StepResult."""

    sched: SchedulerOutput
    pending: PendingStep | StepResult
    recompiled: bool = False  # dispatching it compiled a new program


@dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request_id, first position, number of tokens) per sequence chunk."""

    index: int
    chunks: tuple[tuple[str, int, int], ...]
