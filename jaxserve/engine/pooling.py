"""Pooling requests in the engine (vLLM's pooling requests, `PoolingParams`): embeddings, and the class
probabilities of a sequence classifier.

A pooling request is one sequence that runs its prompt like any other (chunked prefill, prefix cache, batched
with generating requests) with a one-token budget; the step that reaches its last prompt token returns that
row's final hidden state (`StepStatics.return_hidden`: the forward computes it for sampling anyway), the budget
ends the sequence there (its prompt's blocks go to the prefix cache as any other's), and the engine pools that
row (`Engine._on_token`): the embedding, or the classifier head's probabilities. The sampled token is never shown.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.request import Request
from jaxserve.loader.heads import ModelHead
from jaxserve.outputs import ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

# What a pooling request's sequence runs with: it stops after the prompt (its one sample is never kept).
EMBEDDING_STEP = SamplingParams(temperature=0, max_tokens=1)


def step_params(params: SamplingParams | PoolingParams, head: ModelHead, model_name: str, hidden_size: int,
                declared_pooling: str | None) -> SamplingParams:
    """The SamplingParams a request's sequences run with, once its params are checked against the model: a
    pooling request's one-token step, or the request's own where the model generates."""
    if isinstance(params, PoolingParams):
        return check_pooling(params, hidden_size, declared_pooling, head)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams or PoolingParams, got {type(params).__name__}")
    check_generates(head, model_name)
    return params


def check_generates(head: ModelHead, model_name: str) -> None:
    if head.generates:
        return
    if head.classifier is not None:
        raise ValueError(f"{model_name} is a sequence classifier ({head.classifier.architecture}): it classifies "
                         "(/classify, Engine.classify) and scores pairs (/score, /rerank), and does not generate")
    raise ValueError(f"{model_name} has no language-model head (no lm_head.weight): it serves embeddings "
                     "(/v1/embeddings, Engine.embed) and does not generate")


def check_pooling(params: PoolingParams, hidden_size: int, declared: str | None, head: ModelHead
                  ) -> SamplingParams:
    """Validate a pooling request's params against the model (`declared`: the pooling its checkpoint names, if
    any); the SamplingParams its sequence runs with."""
    if params.task == "classify":
        if head.classifier is None:
            raise ValueError("this model has no classification head: classify needs a sequence classifier "
                             "(a *ForSequenceClassification checkpoint)")
        return EMBEDDING_STEP
    if head.classifier is not None:
        raise ValueError(f"this model is a sequence classifier ({head.classifier.architecture}): it classifies and "
                         "scores pairs, and does not embed")
    if declared not in (None, "lasttoken"):
        raise ValueError(f"this model's sentence-transformers config pools by {declared}, and jaxserve embeds by the "
                         "last token only, with no projection (the pooling of Qwen3-Embedding, e5-mistral, "
                         "gte-Qwen2)")
    params.check(hidden_size)
    return EMBEDDING_STEP


def pool(params: PoolingParams, hidden: np.ndarray, head: ModelHead) -> list[float]:
    """A pooling request's result from its last token's final hidden state."""
    if params.task == "classify":
        return head.classifier.probabilities(hidden, activation=params.use_activation is not False)
    return params.pool(hidden)


def pooling_output(request: Request, head: ModelHead) -> EmbeddingRequestOutput | ClassificationRequestOutput:
    seq = request.sequences[0]
    pooled = seq.pooled or []
    if request.pooling.task == "classify":
        label = head.classifier.labels[int(np.argmax(pooled))] if pooled else ""
        outputs = ClassificationOutput(pooled, label)
        return ClassificationRequestOutput(request.request_id, outputs, list(seq.prompt_token_ids), request.finished,
                                           seq.num_cached_tokens)
    return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(pooled), list(seq.prompt_token_ids),
                                  request.finished, seq.num_cached_tokens)
