"""What the engine keeps about its steps: the one in flight; and observers, which see each step once it is read
back (tests record what steps computed and the logits they sampled from; nothing in serving needs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.runner.model_runner import PendingStep, StepResult


@dataclass
class InFlightStep:
    """A dispatched step: what was scheduled, and its device outputs (PendingStep) or, once read, StepResult."""

    sched: SchedulerOutput
    pending: PendingStep | StepResult | None  # None: still inside a pipeline's stages, not sampled yet
    index: int  # the engine's count of steps before it
    # LoRA slots its sequences run with, referenced while it is inside a pipeline's stages (AdapterSlots.hold)
    lora_slots: tuple[int, ...] = ()


class StepObserver(Protocol):
    """Told of every step the engine reads back, in order. `wants_logits`: the step also returns the sampled rows'
    logits (`result.logits`), which serving never copies to the host."""

    wants_logits: bool

    def on_step(self, index: int, sched: SchedulerOutput, sampled: list, result: StepResult) -> None:
        """`sampled`: per chunk, what the scheduler read of it (its token, its drafts' tokens, or None)."""


@dataclass(frozen=True)
class StepRecord:
    """What one step computed: (request_id, first position, number of tokens) per sequence chunk."""

    index: int
    chunks: tuple[tuple[str, int, int], ...]


@dataclass
class StepLog:
    """Records what each step computed (`records`: StepRecord, oldest first)."""

    records: list[StepRecord] = field(default_factory=list)
    wants_logits: bool = False

    def on_step(self, index: int, sched: SchedulerOutput, sampled: list, result: StepResult) -> None:
        self.records.append(StepRecord(index, tuple((c.seq.request_id, c.start, c.num_tokens) for c in sched.chunks)))


@dataclass
class LogitsLog:
    """Records (the sequence's tokens before a sampled token, the logits it was sampled from) for each token kept:
    the parity tests compare these with transformers' logits."""

    rows: list[tuple[list[int], object]] = field(default_factory=list)
    wants_logits: bool = True

    def on_step(self, index: int, sched: SchedulerOutput, sampled: list, result: StepResult) -> None:
        for row, c, tokens in zip(sched.first_rows(), sched.chunks, sampled):
            if c.samples and not c.seq.finished:
                kept = len(c.accepted(tokens)) if c.draft else 1
                self.rows.extend((c.seq.token_ids[: c.end] + c.draft[:i], result.logits[row + i])
                                 for i in range(kept))
