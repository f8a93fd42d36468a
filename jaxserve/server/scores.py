"""POST /score and /rerank, as vLLM serves them for embedding models: every text is embedded as /v1/embeddings
embeds it, and a pair's score is the cosine similarity of the two embeddings (scoring.py). /rerank is the
Jina/Cohere shape: one query against documents, answered most relevant first."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import EmbeddingRequestOutput
from jaxserve.scoring import as_prompts, cosine_similarity, score_pairs
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


class ScoreRequest(PooledRequest):
    text_1: str | list[str]
    text_2: str | list[str]

    def texts(self) -> tuple[list[str], list[str]]:
        return _check_texts(as_prompts(self.text_1), "text_1"), _check_texts(as_prompts(self.text_2), "text_2")

    def prompts(self) -> list[str]:
        """What is embedded: text_1's texts, then text_2's."""
        first, second = self.texts()
        try:
            score_pairs(len(first), len(second))
        except ValueError as exc:
            raise bad_request(str(exc), param="text_2") from None
        return first + second


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(PooledRequest):
    query: str
    documents: list[str | RerankDocument]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def prompts(self) -> list[str]:
        """What is embedded: the query, then each document."""
        return _check_texts([self.query], "query") + _check_texts(self.document_texts(), "documents")


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
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


@dataclass
class ScoreRendering:
    """How one /score request's embeddings (text_1's, then text_2's) become its response."""

    request: ScoreRequest
    model: str
    request_id: str

    def full_response(self, finals: list[EmbeddingRequestOutput]) -> ScoreResponse:
        first, second = self.request.texts()
        vectors = [out.outputs.embedding for out in finals]
        data = [ScoreData(index=k, score=cosine_similarity(vectors[i], vectors[len(first) + j]))
                for k, (i, j) in enumerate(score_pairs(len(first), len(second)))]
        tokens = prompt_token_count(finals)
        return ScoreResponse(id=self.request_id, model=self.model, data=data,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


@dataclass
class RerankRendering:
    """How one /rerank request's embeddings (the query's, then each document's) become its response."""

    request: RerankRequest
    model: str
    request_id: str

    def full_response(self, finals: list[EmbeddingRequestOutput]) -> RerankResponse:
        query, *documents = [out.outputs.embedding for out in finals]
        texts = self.request.document_texts()
        results = [RerankResult(index=i, relevance_score=cosine_similarity(query, document),
                                document=RerankDocument(text=texts[i]) if self.request.return_documents else None)
                   for i, document in enumerate(documents)]
        results.sort(key=lambda result: -result.relevance_score)  # stable: equal scores keep the documents' order
        top_n = self.request.top_n or len(results)
        return RerankResponse(id=self.request_id, model=self.model, results=results[:top_n],
                              usage=RerankUsage(total_tokens=prompt_token_count(finals)))


async def create_score(request: Request) -> Response:
    return await serve_pooled(request, ScoreRequest, ScoreRendering, "score")


async def create_rerank(request: Request) -> Response:
    return await serve_pooled(request, RerankRequest, RerankRendering, "rerank")
