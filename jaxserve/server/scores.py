"""POST /score and /rerank, as vLLM serves them (scoring.py): with an embedding model every text is embedded as
/v1/embeddings embeds it, and a pair's score is the cosine similarity of the two embeddings; with a cross-encoder
(a one-label sequence classifier) each pair is one prompt, scored by the classifier. /rerank is the Jina/Cohere
shape: one query against documents, answered most relevant first."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.core.scoring import as_prompts, check_cross_encoder, cross_encoder_prompts, pair_scores, score_pairs
from jaxserve.outputs import ClassificationRequestOutput, EmbeddingRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.embeddings import PooledRequest, serve_pooled
from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import OpenAIModel, UsageInfo
from jaxserve.server.response_bodies import prompt_token_count


def _check_texts(texts: list[str], param: str) -> list[str]:
    if not texts:
        raise bad_request(f"{param} must not be empty", param=param)
    if any(not text for text in texts):
        raise bad_request(f"{param} has an empty string; every text needs at least one token", param=param)
    return texts


def _pair_inputs(request: PooledRequest, engine, first: list[str], second: list[str], pairs: list[tuple[int, int]]
                 ) -> tuple[list, PoolingParams]:
    """The engine's prompts and params for scoring `pairs` of the texts: each text, then a pair's score the
    cosine of two embeddings; or, on a cross-encoder, one prompt per pair."""
    if engine.head.classifier is None:
        return first + second, request.pooling_params()
    check_cross_encoder(engine.head.classifier)  # a ValueError: a 400
    prompts = cross_encoder_prompts(engine.tokenizer, first, second, pairs, request.truncate_prompt_tokens,
                                    engine.max_model_len, engine.head.classifier.pair_encoding)
    return prompts, request.pooling_params(task="classify")


class ScoreRequest(PooledRequest):
    text_1: str | list[str]
    text_2: str | list[str]

    def texts(self) -> tuple[list[str], list[str]]:
        return _check_texts(as_prompts(self.text_1), "text_1"), _check_texts(as_prompts(self.text_2), "text_2")

    def pairs(self) -> list[tuple[int, int]]:
        first, second = self.texts()
        try:
            return score_pairs(len(first), len(second))
        except ValueError as exc:
            raise bad_request(str(exc), param="text_2") from None

    def engine_inputs(self, engine) -> tuple[list, PoolingParams]:
        return _pair_inputs(self, engine, *self.texts(), self.pairs())


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(PooledRequest):
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def pairs(self) -> list[tuple[int, int]]:
        return [(0, j) for j in range(len(self.documents))]

    def engine_inputs(self, engine) -> tuple[list, PoolingParams]:
        query, documents = _check_texts([self.query], "query"), _check_texts(self.document_texts(), "documents")
        return _pair_inputs(self, engine, query, documents, self.pairs())


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIModel):
    prompt_tokens: int  # vLLM's; the same as total_tokens
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


@dataclass
class ScoreRendering:
    """How one /score request's outputs (`_pair_inputs`' prompts) become its response."""

    request: ScoreRequest
    model: str
    request_id: str

    def full_response(self, finals: list[EmbeddingRequestOutput | ClassificationRequestOutput]) -> ScoreResponse:
        scores = pair_scores(finals, len(self.request.texts()[0]), self.request.pairs())
        data = [ScoreData(index=k, score=score) for k, score in enumerate(scores)]
        tokens = prompt_token_count(finals)
        return ScoreResponse(id=self.request_id, model=self.model, data=data,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


@dataclass
class RerankRendering:
    """How one /rerank request's outputs (`_pair_inputs`' prompts) become its response."""

    request: RerankRequest
    model: str
    request_id: str

    def full_response(self, finals: list[EmbeddingRequestOutput | ClassificationRequestOutput]) -> RerankResponse:
        texts = self.request.document_texts()
        results = [RerankResult(index=i, relevance_score=score,
                                document=RerankDocument(text=texts[i]) if self.request.return_documents else None)
                   for i, score in enumerate(pair_scores(finals, 1, self.request.pairs()))]
        results.sort(key=lambda result: -result.relevance_score)  # stable: equal scores keep the documents' order
        top_n = self.request.top_n or len(results)
        return RerankResponse(id=self.request_id, model=self.model, results=results[:top_n],
                              usage=RerankUsage(prompt_tokens=(tokens := prompt_token_count(finals)),
                                                total_tokens=tokens))


async def create_score(request: Request) -> Response:
    return await serve_pooled(request, ScoreRequest, ScoreRendering, "score")


async def create_rerank(request: Request) -> Response:
    return await serve_pooled(request, RerankRequest, RerankRendering, "rerank")
