"""POST /v1/embeddings (OpenAI's Embeddings API, as vLLM serves it): each input's embedding is the model's final
hidden state at its last token, unit length (engine/pooling.py); `encoding_format: "base64"` sends the float32
bytes, which OpenAI's SDK decodes by default."""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import EmbeddingRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.errors import bad_request, parse_json
from jaxserve.server.protocol import OpenAIModel, RequestModel, UsageInfo
from jaxserve.server.request_bodies import checked_params, parse_request
from jaxserve.server.serving import ServerState, collect_final_outputs, request_ids, start_requests
from jaxserve.server.streaming import cancel_on_disconnect

EmbeddingInput = str | list[str] | list[int] | list[list[int]]
# embed_dtype -> the numpy type base64 packs (ml_dtypes' for the narrow floats, as vLLM packs them)
EMBED_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


class PooledRequest(RequestModel):
    """What `serve_pooled` reads from a body that pools texts: its fields below and `engine_inputs()` (by default
    its `prompts()` with its `pooling_params()`)."""

    model: str | None = None
    user: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "right"  # vLLM's: "left" keeps the last k tokens
    use_activation: bool | None = None  # vLLM's: false gives raw vectors (unnormalized) or a classifier's logits
    cache_salt: str | None = Field(None, min_length=1)  # only requests with the same salt share prefix-cache blocks

    def pooling_params(self, **task) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side,
                             use_activation=self.use_activation, **task)

    def engine_inputs(self, engine) -> tuple[list[str | list[int]], PoolingParams]:
        """The engine's prompts and params for this body, given the model it runs on (`engine.head`: what the
        model's final hidden state feeds, loader/heads.py)."""
        return self.prompts(), self.pooling_params()


class InputRequest(PooledRequest):
    """A body whose `input` holds the texts (a string, strings, token ids or lists of them): one prompt each."""

    input: EmbeddingInput

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per input: a string, or a list of token ids."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise bad_request("input must not be empty: give a string, a list of strings or token ids", param="input")
        for prompt in given:
            if not prompt:
                raise bad_request("input has an empty string or token list; every input needs at least one token",
                                  param="input")
        return list(given)


class EmbeddingRequest(InputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    # vLLM's: the numbers base64 carries, and their byte order
    embed_dtype: Literal[tuple(EMBED_DTYPES)] = "float32"
    endianness: Literal["native", "big", "little"] = "native"

    def pooling_params(self, **task) -> PoolingParams:
        return super().pooling_params(dimensions=self.dimensions, **task)


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str  # vLLM's; OpenAI's embeddings carry none
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


@dataclass
class EmbeddingRendering:
    """How one embedding request's finished outputs become its response (the batch job renders with it too)."""

    request: EmbeddingRequest
    model: str
    request_id: str

    def full_response(self, finals: list[EmbeddingRequestOutput]) -> EmbeddingResponse:
        data = [EmbeddingData(index=i, embedding=_encode(out.outputs.embedding, self.request))
                for i, out in enumerate(finals)]
        num_tokens = sum(len(out.prompt_token_ids) for out in finals)
        return EmbeddingResponse(id=self.request_id, data=data, model=self.model,
                                 usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))


async def create_embedding(request: Request) -> Response:
    return await serve_pooled(request, EmbeddingRequest, EmbeddingRendering, "embd")


async def serve_pooled(request: Request, schema: type[PooledRequest], rendering_class: type, id_prefix: str
                       ) -> Response:
    """Run the body's pooling requests (`engine_inputs()`) and answer with what `rendering_class` makes of their
    outputs (embeddings, class probabilities, scores, a ranking)."""
    state: ServerState = request.app.state.server
    body = parse_request(schema, await parse_json(request))
    model = state.resolve_model(body.model)
    response_id, engine_id = request_ids(id_prefix, request.headers, None)
    rendering = rendering_class(body, model, response_id)
    # In a thread: a cross-encoder's inputs are tokenized here, which must not stall the streams of other requests.
    prompts, params = await asyncio.to_thread(checked_params, body, lambda: body.engine_inputs(state.engine))
    streams = await start_requests(state, prompts, params, engine_id, body.priority, model, body.cache_salt)
    completed, finals = await cancel_on_disconnect(request, collect_final_outputs(state, streams, time.monotonic()))
    if not completed:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(rendering.full_response(finals).model_dump())


def _encode(embedding: list[float], request: EmbeddingRequest) -> list[float] | str:
    if request.encoding_format == "float":
        return embedding
    packed = np.asarray(embedding, np.float32).astype(EMBED_DTYPES[request.embed_dtype])
    if request.endianness != "native" and request.endianness != sys.byteorder:
        packed = packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
