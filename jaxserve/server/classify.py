"""POST /classify (vLLM's Classification API): a sequence classifier's class probabilities for each input, and
the most probable class's label (engine/pooling.py, loader/heads.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.outputs import ClassificationRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.embeddings import InputRequest, serve_pooled
from jaxserve.server.protocol import OpenAIModel, UsageInfo
from jaxserve.server.response_bodies import prompt_token_count


class ClassificationRequest(InputRequest):
    def pooling_params(self, **task) -> PoolingParams:
        return super().pooling_params(task="classify", **task)


class ClassificationData(OpenAIModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


@dataclass
class ClassificationRendering:
    """How one /classify request's outputs become its response (the batch job renders with it too)."""

    request: ClassificationRequest
    model: str
    request_id: str

    def full_response(self, finals: list[ClassificationRequestOutput]) -> ClassificationResponse:
        data = [ClassificationData(index=i, label=out.outputs.label, probs=out.outputs.probs,
                                   num_classes=out.outputs.num_classes) for i, out in enumerate(finals)]
        tokens = prompt_token_count(finals)
        return ClassificationResponse(id=self.request_id, model=self.model, data=data,
                                      usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


async def create_classification(request: Request) -> Response:
    return await serve_pooled(request, ClassificationRequest, ClassificationRendering, "classify")
