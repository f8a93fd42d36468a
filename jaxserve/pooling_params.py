"""`PoolingParams`: what a pooling request asks for (vLLM's `vllm.PoolingParams`, the fields embedding and
classification use)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.sampling_params import check_truncate_prompt_tokens

TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding of the whole prompt: the final hidden state (after the model's last norm) at its last token,
    the pooling of decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2).

    `dimensions`: keep the first `dimensions` values (Matryoshka models such as Qwen3-Embedding are trained so
    that a prefix is itself an embedding; None keeps all). `normalize`: scale to unit length (after truncating),
    so a dot product is the cosine similarity.

    `task="classify"` asks a sequence classifier for its class probabilities instead (`Engine.classify`; the
    last token's hidden state through the checkpoint's classification head, loader/heads.py).

    `use_activation` (vLLM's): False gives an embedding unnormalized, a classification's raw logits; None the
    default (`normalize` for an embedding, the head's activation for a classification)."""

    dimensions: int | None = None
    normalize: bool = True
    # Embed only the prompt's first k tokens (-1: the most the context holds), as vLLM 0.34 truncates pooling
    # prompts (SamplingParams' keeps the last k); truncation_side "left" keeps the last k instead.
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    use_activation: bool | None = None
    truncation_side: str = "right"

    def __post_init__(self):
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be true, false or None, got {self.use_activation!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}, got {self.task!r}")
        if self.task == "classify" and self.dimensions is not None:
            raise ValueError("dimensions applies to embeddings; a classification returns every class")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")

    def clone(self) -> PoolingParams:
        return self  # frozen: one object serves every request made with it

    def check(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is more than the model's {hidden_size}; ask for at most "
                             f"{hidden_size}")

    def pool(self, hidden: np.ndarray) -> list[float]:
        """The embedding from the last token's hidden state [D]."""
        vector = np.asarray(hidden, np.float32)[: self.dimensions]
        if self.normalize if self.use_activation is None else self.use_activation:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.tolist()
