"""Host-side request state. A request asks for `n` (or `best_of`) samples; each is one `Sequence`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's samples this is
    token_ids: list[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # the sequence's own random stream
    arrival: int  # admission order, for first-come-first-served
    priority: int = 0  # lower runs first (vLLM's convention)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)  # per generated token, when asked
    prompt_logprobs: list = field(default_factory=list)  # per prompt position, when asked

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def stop_after(self, token: int) -> tuple[str, int | None] | None:
        """The finish reason (and stop token) once `token` has been appended, or None to go on."""
        p = self.params
        n_out = self.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length", None
        if self.num_tokens >= self.max_model_len:
            return "length", None
        return None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    sequences: list[Sequence]
    params: SamplingParams

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)
