"""The OpenAI-compatible HTTP app (Starlette): routes, API-key check, error handlers, lifespan.

`build_app(async_engine, ...)` is all a caller needs; the app talks to the model only through the AsyncEngine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import jaxserve
from jaxserve.async_engine.engine import AsyncEngine, EngineDeadError, QueueFull, RequestTimedOut
from jaxserve.server.chat import create_chat_completion
from jaxserve.server.chat_protocol import ChatMessageParam, template_kwargs
from jaxserve.server.classify import create_classification
from jaxserve.server.completions import create_completion
from jaxserve.server.embeddings import create_embedding
from jaxserve.server.errors import (
    APIError,
    bad_request,
    handle_api_error,
    handle_client_disconnect,
    handle_http_exception,
    invalid_api_key,
    parse_json,
)
from jaxserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from jaxserve.server.lora_admin import load_lora_adapter, unload_lora_adapter
from jaxserve.server.metrics import PREFIX, VLLM_PREFIX, ServerMetrics
from jaxserve.server.openapi import docs_page, openapi_json
from jaxserve.server.request_bodies import parse_request
from jaxserve.server.response_bodies import OutputOptions
from jaxserve.server.responses import create_response, delete_response, retrieve_response
from jaxserve.server.scores import create_rerank, create_score
from jaxserve.server.serving import ServerState
from jaxserve.server.stats_log import StatsLogger
from jaxserve.server.transport import CORSPolicy, RequestIdMiddleware, RootPathMiddleware, needs_api_key, route_path
from jaxserve.server.utility_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which breaks streaming disconnects): check `Authorization: Bearer`."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if self._needs_key(scope) and not self._authorised(Headers(scope=scope)):
            await invalid_api_key().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _needs_key(self, scope) -> bool:
        return (bool(self.expected) and scope["type"] == "http" and scope["method"] != "OPTIONS"
                # The routed path, not the raw one: under --root-path /llm, /llm/v1/models is /v1/models.
                and needs_api_key(route_path(scope)))

    def _authorised(self, headers: Headers) -> bool:
        given = headers.get("authorization", "").encode()
        # Constant time, so a key cannot be guessed byte by byte from response timings; every key is compared.
        return sum(hmac.compare_digest(given, expected) for expected in self.expected) > 0


def _key_list(api_key: str | list[str] | None) -> list[str]:
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    return [key for key in keys if key]  # an empty key (say, an unset variable in a manifest) is no key


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    cards = [ModelCard(id=name, root=state.engine.model_name, max_model_len=state.engine.max_model_len)
             for name in state.served_model_names]
    cards += [ModelCard(id=name, root=lora.lora_path, parent=state.served_model_names[0],
                        max_model_len=state.engine.max_model_len) for name, lora in state.lora_adapters.items()]
    return JSONResponse(ModelList(data=cards).model_dump())


async def tokenize(request: Request) -> JSONResponse:
    state = _state(request)
    body = parse_request(TokenizeRequest, await parse_json(request))
    state.resolve_model(body.model)
    tokenizer = state.engine.tokenizer
    if body.messages is not None:
        # Through the same message schema as chat completions, so both count the same tokens.
        messages = [ChatMessageParam.model_validate(message).to_template_dict() for message in body.messages]
        tokens = await asyncio.to_thread(state.engine.encode_chat, messages, body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=template_kwargs(state.default_chat_template_kwargs,
                                                                              body.chat_template_kwargs),
                                         tools=body.tools)
    elif body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise bad_request("Pass either `prompt` or `messages`", param="prompt")
    token_strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    response = TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens,
                                token_strs=token_strs)
    return JSONResponse(response.model_dump(exclude_none=True))


async def detokenize(request: Request) -> JSONResponse:
    state = _state(request)
    body = parse_request(DetokenizeRequest, await parse_json(request))
    state.resolve_model(body.model)
    vocab_size = len(state.engine.tokenizer)
    outside = [token for token in body.tokens if not 0 <= token < vocab_size]
    if outside:
        raise bad_request(f"token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=state.decode(body.tokens)).model_dump())


async def health(request: Request) -> Response:
    engine = _state(request).engine
    hung = engine.is_hung  # read once: a step may return between two reads
    if engine.is_healthy and not hung:
        return Response(status_code=200)
    if engine.is_draining:  # requests in flight still finish; load balancers should send new ones elsewhere
        return APIError(503, "The server is shutting down", "server_error", code="shutting_down").response()
    if hung:
        return APIError(503, f"An engine step has run for over {engine.step_timeout:g} s (--step-timeout); see "
                             "the server log", "server_error", code="engine_hung").response()
    return APIError(503, "The engine is not running; see the server log for the cause", "server_error",
                    code="engine_dead").response()


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": jaxserve.__version__})


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


ROUTES = [
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/embeddings", create_embedding, methods=["POST"]),
    *(Route(path, create_classification, methods=["POST"]) for path in ("/classify", "/v1/classify")),
    *(Route(path, create_score, methods=["POST"]) for path in ("/score", "/v1/score")),
    *(Route(path, create_rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
API_DESCRIPTION = [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs_page, methods=["GET"])]


def build_app(async_engine: AsyncEngine, served_model_names: list[str] | None = None,
              api_key: str | list[str] | None = None, shutdown_engine: bool = True,
              max_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
              default_chat_template_kwargs: dict | None = None, tool_parser=None,
              reasoning_parser=None, lora_adapters: dict | None = None,
              runtime_lora_updating: bool = False, cors: CORSPolicy | None = None, root_path: str = "",
              log_stats_interval: float | None = None, output_options: OutputOptions | None = None,
              request_id_headers: bool = False, vllm_metric_names: bool = False,
              api_description: bool = True) -> Starlette:
    """The HTTP app over `async_engine`; it serves the model under `served_model_names` (default: its name),
    and each of `lora_adapters` (name -> LoRARequest) under its name; `runtime_lora_updating` opens the routes
    that load and unload adapters.

    `api_key`: the key, or keys, /v1 routes require (None: open).
    Bodies over `max_body_bytes` are refused with 413 (None: no limit). `cors`: which browser origins may call
    it (None: no CORS headers, so only same-origin pages). `root_path`: the prefix a proxy serves it under
    (server/transport.py). `log_stats_interval`: seconds between the engine stats lines in the log (None: none).
    `output_options`: what completion and chat bodies carry beyond OpenAI's fields (vLLM's flags).
    `request_id_headers`: every response carries an X-Request-Id header. `vllm_metric_names`: /metrics names its
    series vllm:NAME instead of jaxserve:NAME. `api_description`: serve /openapi.json and /docs (open, as in
    vLLM; vLLM's --disable-fastapi-docs turns them off).
    """
    names = list(served_model_names or [async_engine.model_name])
    metrics = ServerMetrics(async_engine, names[0], VLLM_PREFIX if vllm_metric_names else PREFIX)
    state = ServerState(async_engine, names, metrics,
                        default_chat_template_kwargs, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                        lora_adapters=dict(lora_adapters or {}), runtime_lora_updating=runtime_lora_updating,
                        output_options=output_options or OutputOptions())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        stats_lines = None
        if log_stats_interval:
            stats_lines = asyncio.create_task(StatsLogger(state.metrics, async_engine, log_stats_interval).run())
        yield
        if stats_lines is not None:
            stats_lines.cancel()
        if shutdown_engine:
            await asyncio.to_thread(async_engine.shutdown)

    expected_failures = (APIError, ValueError, QueueFull, EngineDeadError, RequestTimedOut)
    handlers = {error: handle_api_error for error in (*expected_failures, Exception)}
    handlers[HTTPException] = handle_http_exception
    handlers[ClientDisconnect] = handle_client_disconnect
    routes = ROUTES + (API_DESCRIPTION if api_description else [])
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[*([Middleware(RequestIdMiddleware)] if request_id_headers else []),
                                *([Middleware(RootPathMiddleware, root_path=root_path)] if root_path else []),
                                *([cors.middleware()] if cors else []),  # errors get CORS headers too
                                Middleware(APIKeyMiddleware, api_keys=_key_list(api_key)),
                                Middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)])
    app.state.server = state
    return app
