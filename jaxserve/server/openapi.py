"""/openapi.json: the server's OpenAPI 3.1 description, as vLLM's server publishes one (clients, gateways and API
fuzzers read it), and /docs, which renders it.

Built from the pydantic models the routes validate their bodies with and answer with, so the schemas are the ones
requests are checked against. Every route of the app is listed here (a test holds the two to each other); an
operation whose body or answer has no model of its own says "object".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

import jaxserve
from jaxserve.server.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from jaxserve.server.classify import ClassificationRequest, ClassificationResponse
from jaxserve.server.embeddings import EmbeddingRequest, EmbeddingResponse
from jaxserve.server.lora_admin import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.server.protocol import CompletionRequest, CompletionResponse, ErrorResponse
from jaxserve.server.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from jaxserve.server.scores import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from jaxserve.server.transport import needs_api_key
from jaxserve.server.utility_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Operation:
    method: str
    paths: tuple[str, ...]  # one operation served under several paths (vLLM's aliases)
    summary: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    streams: bool = False  # with "stream": true the answer is server-sent events


OPERATIONS = (
    Operation("post", ("/v1/completions",), "Complete a prompt", CompletionRequest, CompletionResponse, True),
    Operation("post", ("/v1/chat/completions",), "Answer a chat", ChatCompletionRequest, ChatCompletionResponse,
              True),
    Operation("post", ("/v1/embeddings",), "Embed inputs", EmbeddingRequest, EmbeddingResponse),
    Operation("post", ("/classify", "/v1/classify"), "Classify inputs", ClassificationRequest,
              ClassificationResponse),
    Operation("post", ("/score", "/v1/score"), "Score pairs of texts", ScoreRequest, ScoreResponse),
    Operation("post", ("/rerank", "/v1/rerank", "/v2/rerank"), "Rerank documents against a query", RerankRequest,
              RerankResponse),
    Operation("post", ("/v1/responses",), "Create a response (the Responses API)", ResponsesRequest, ResponseObject,
              True),
    Operation("get", ("/v1/responses/{response_id}",), "Retrieve a stored response", answer=ResponseObject),
    Operation("delete", ("/v1/responses/{response_id}",), "Delete a stored response", answer=DeletedResponse),
    Operation("get", ("/v1/models",), "List the served models", answer=ModelList),
    Operation("post", ("/v1/load_lora_adapter",), "Load a LoRA adapter (--enable-runtime-lora-updating)",
              LoadLoRAAdapterRequest),
    Operation("post", ("/v1/unload_lora_adapter",), "Unload a LoRA adapter (--enable-runtime-lora-updating)",
              UnloadLoRAAdapterRequest),
    Operation("post", ("/tokenize",), "Tokenize a prompt or chat", TokenizeRequest, TokenizeResponse),
    Operation("post", ("/detokenize",), "Detokenize token ids", DetokenizeRequest, DetokenizeResponse),
    Operation("get", ("/health",), "Whether the engine runs (200) or not (503)"),
    Operation("get", ("/version",), "The server's version"),
    Operation("get", ("/metrics",), "Prometheus metrics"),
)


@cache
def openapi_document() -> dict[str, Any]:
    models = {m for op in OPERATIONS for m in (op.body, op.answer) if m is not None} | {ErrorResponse}
    refs, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                    ref_template=REF)
    ref = {model: schema for (model, _), schema in refs.items()}
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        for path in op.paths:
            paths.setdefault(path, {})[op.method] = _operation(op, path, ref)
    return {"openapi": "3.1.0",
            "info": {"title": "jaxserve", "version": jaxserve.__version__,
                     "description": "OpenAI-compatible inference server (vLLM's API)"},
            "paths": paths,
            "components": {"schemas": defs.get("$defs", {}),
                           "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}}}}


def _operation(op: Operation, path: str, ref: dict) -> dict[str, Any]:
    answer = ref[op.answer] if op.answer is not None else {"type": "object"}
    content = {"application/json": {"schema": answer}}
    if op.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    error = {"content": {"application/json": {"schema": ref[ErrorResponse]}}}
    operation: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{op.method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        "responses": {"200": {"description": "OK", "content": content},
                      "400": {"description": "A request the server refuses, and why", **error}},
    }
    if op.body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[op.body]}}}
    if "{response_id}" in path:
        operation["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                    "schema": {"type": "string"}}]
    if needs_api_key(path):
        operation["security"] = [{"apiKey": []}, {}]  # the key is needed only when the server was given one
    return operation


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(openapi_document())


SWAGGER_UI = """<!doctype html>
<html><head><title>jaxserve API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "openapi.json", dom_id: "#ui"});</script></body></html>
"""


async def docs_page(request: Request) -> HTMLResponse:
    """Swagger UI over /openapi.json (its scripts come from a CDN, as FastAPI's /docs does)."""
    return HTMLResponse(SWAGGER_UI)
