"""What the engine returns to callers (the shapes vLLM users know)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when unknown
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled/actual token plus the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None  # None unless logprobs were asked for (or best_of needed them)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PoolingRequestOutput:
    """A pooling request's result (vLLM's `PoolingRequestOutput`): it arrives once, finished, and generates no
    tokens; its subclasses say what `outputs` holds."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """An embedding request's result (vLLM's `EmbeddingRequestOutput`)."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per class: a softmax, a sigmoid (one label, multi-label), or the logits (regression)
    label: str  # the most probable class's label (config.json's id2label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """A classification request's result (vLLM's `ClassificationRequestOutput`)."""

    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's `ScoringRequestOutput`): the cosine similarity of the two texts' embeddings, or a
    cross-encoder's relevance of the pair; `prompt_token_ids` are the first text's then the second's (a
    cross-encoder's: the pair as it read it)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
