"""Embedding requests in the engine (vLLM's pooling requests, `PoolingParams`).

An embedding request is one sequence that runs its prompt like any other (chunked prefill, prefix cache, batched
with generating requests) with a one-token budget; the step that reaches its last prompt token returns that
row's final hidden state (`StepStatics.return_hidden`: the forward computes it for sampling anyway), the budget
ends the sequence there (its prompt's blocks go to the prefix cache as any other's), and the engine takes the
embedding from that row (`Engine._on_token`); the sampled token is never shown.
"""

from __future__ import annotations

from jaxserve.core.request import Request
from jaxserve.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

# What an embedding request's sequence runs with: it stops after the prompt (its one sample is never kept).
EMBEDDING_STEP = SamplingParams(temperature=0, max_tokens=1)


def check_pooling(params: PoolingParams, hidden_size: int, declared: str | None) -> SamplingParams:
    """Validate an embedding request's params against the model (`declared`: the pooling its checkpoint names, if
    any); the SamplingParams its sequence runs with."""
    if declared not in (None, "lasttoken"):
        raise ValueError(f"this model's sentence-transformers config pools by {declared}, and jaxserve embeds by the "
                         "last token only (the pooling of Qwen3-Embedding, e5-mistral, gte-Qwen2)")
    params.check(hidden_size)
    return EMBEDDING_STEP


def embedding_output(request: Request) -> EmbeddingRequestOutput:
    seq = request.sequences[0]
    return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(seq.embedding or []),
                                  list(seq.prompt_token_ids), request.finished, seq.num_cached_tokens)
