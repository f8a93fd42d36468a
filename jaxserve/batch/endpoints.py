"""The endpoints a batch line may call, built on the HTTP server's own body functions.

`request_bodies` (body -> prompts, SamplingParams) and `response_bodies` (outputs -> body) are the very code the
HTTP routes run, so a batch line answers exactly as the API would; only `id` and `created` differ.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.classify import ClassificationRendering, ClassificationRequest
from jaxserve.server.embeddings import EmbeddingRendering, EmbeddingRequest
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import OUTPUT_CONSTRAINT_FIELDS, CompletionRequest, SamplingFields
from jaxserve.server.request_bodies import (
    Prompt,
    build_sampling_params,
    chat_inputs,
    completion_inputs,
    parse_request,
    resolve_model_name,
)
from jaxserve.server.response_bodies import ChatRendering, CompletionRendering, OutputParsers
from jaxserve.server.scores import RerankRendering, RerankRequest, ScoreRendering, ScoreRequest

Rendering = CompletionRendering | ChatRendering | EmbeddingRendering | ScoreRendering | RerankRendering

# Body fields that make no sense as job-wide defaults (each request has its own prompt) or in a batch at all.
NOT_DEFAULTS = {"prompt", "messages", "stream", "stream_options", "request_id", "chat_template"}


@dataclass(frozen=True)
class Endpoint:
    schema: type
    id_prefix: str  # of the response body's `id`, as the HTTP API makes it
    # (request, engine, output parsers) -> prompts, params
    inputs: Callable[[Any, Any, OutputParsers], tuple[list[Prompt], SamplingParams]]
    # (request, model name, response id, tokenizer, output parsers, prompts, params) -> how outputs become the
    # response body
    rendering: Callable[[Any, str, str, Any, OutputParsers, list[Prompt], SamplingParams],
                        Rendering]
    render: Callable[[Any, list[RequestOutput]], Any]  # (rendering, finals in prompt order) -> response model
    example_body: dict  # the smallest valid body, to check sampling defaults against


def _pooled(schema: type, id_prefix: str, rendering_class: type, example_body: dict) -> Endpoint:
    """An endpoint that runs its body's pooling requests (`engine_inputs`) and renders their outputs (embeddings,
    class probabilities, scores, a ranking)."""
    return Endpoint(schema=schema, id_prefix=id_prefix,
                    inputs=lambda request, engine, _: request.engine_inputs(engine),
                    rendering=lambda request, model, response_id, *_: rendering_class(request, model, response_id),
                    render=lambda rendering, finals: rendering.full_response(finals), example_body=example_body)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/completions": Endpoint(
        schema=CompletionRequest, id_prefix="cmpl",
        inputs=lambda request, engine, _: completion_inputs(request, engine.generation_defaults, engine.tokenizer),
        rendering=lambda request, model, response_id, tokenizer, *_: CompletionRendering(request, model, response_id,
                                                                                          tokenizer),
        render=lambda rendering, finals: rendering.full_response(finals),
        example_body={"prompt": "x"}),
    "/v1/chat/completions": Endpoint(
        schema=ChatCompletionRequest, id_prefix="chatcmpl",
        inputs=lambda request, engine, parsers: chat_inputs(request, engine.encode_chat, engine.generation_defaults,
                                                            tool_parser=parsers.tool, reasoning_parser=parsers.reasoning),
        rendering=lambda request, model, response_id, tokenizer, parsers, prompts, params: ChatRendering(
            request, model, response_id, tokenizer, parsers.tool, parsers.bind_reasoning(prompts[0], params)),
        render=lambda rendering, finals: rendering.full_response(finals[0]),
        example_body={"messages": [{"role": "user", "content": "x"}]}),
    "/v1/embeddings": _pooled(EmbeddingRequest, "embd", EmbeddingRendering, {"input": "x"}),
    "/v1/score": _pooled(ScoreRequest, "score", ScoreRendering, {"text_1": "x", "text_2": "y"}),
    "/v1/rerank": _pooled(RerankRequest, "rerank", RerankRendering, {"query": "x", "documents": ["y"]}),
    "/v1/classify": _pooled(ClassificationRequest, "classify", ClassificationRendering, {"input": "x"}),
}
# The other spellings the server answers at (and vLLM's batch runner takes).
ENDPOINTS |= {"/score": ENDPOINTS["/v1/score"], "/rerank": ENDPOINTS["/v1/rerank"],
              "/v2/rerank": ENDPOINTS["/v1/rerank"], "/classify": ENDPOINTS["/v1/classify"]}


@dataclass
class PreparedRequest:
    """One batch line ready for the engine: its prompts and params, and how to render the finished outputs."""

    endpoint: Endpoint
    rendering: Rendering
    prompts: list[Prompt]
    params: SamplingParams | PoolingParams
    priority: int
    lora_request: LoRARequest | None = None  # the adapter the body's `model` names
    cache_salt: str | None = None  # vLLM's: the prefix cache is shared only between requests with the same salt

    @property
    def request_id(self) -> str:
        return self.rendering.request_id

    def response_body(self, finals: list[RequestOutput]) -> dict:
        """The body HTTP would send, from each prompt's final output in prompt order."""
        return self.endpoint.render(self.rendering, finals).model_dump()


# Fields that make one choice between them (two spellings of a length; the ways of constraining the output): a body
# setting any one of a group overrides the job's defaults for the whole group, so the body wins, as documented.
ONE_CHOICE_FIELDS = (
    frozenset({"max_tokens", "max_completion_tokens"}),
    frozenset({*OUTPUT_CONSTRAINT_FIELDS, "tools", "tool_choice"}),
)


def parse_body(url: str, body: dict, defaults: dict) -> tuple[Any, SamplingParams]:
    """The body (over the job's sampling defaults: those its endpoint has) parsed and its params built; an
    APIError as HTTP gives."""
    schema = ENDPOINTS[url].schema
    overridden = {key for group in ONE_CHOICE_FIELDS if body.keys() & group for key in group}
    merged = {**{key: value for key, value in defaults.items() if key in schema.model_fields and key not in overridden},
              **body}
    if merged.get("stream"):
        raise bad_request("stream is not supported in a batch job; remove it from the body", param="stream")
    if "request_id" in merged:  # each line's result is found by its custom_id; response ids are the job's own
        raise bad_request("request_id is not used in a batch job: a line's custom_id names its result; remove it "
                          "from the body", param="request_id")
    request = parse_request(schema, merged)
    return request, build_sampling_params(request) if isinstance(request, SamplingFields) else None


def new_request_id(url: str) -> str:
    """A response id of the form the HTTP API gives (`cmpl-...`, `chatcmpl-...`)."""
    return f"{ENDPOINTS[url].id_prefix}-{uuid.uuid4().hex}"


def prepare(url: str, body: dict, defaults: dict, request_id: str, engine, served_model_names: list[str],
            parsers: OutputParsers = OutputParsers(), lora_adapters: dict[str, LoRARequest] | None = None,
            ) -> PreparedRequest:
    """Everything HTTP does before queueing: parse, pick the model name (or LoRA adapter), build prompts and
    params. `parsers`: the job's tool_call_parser (chat bodies with tool_choice "auto") and reasoning_parser."""
    endpoint = ENDPOINTS[url]
    adapters = lora_adapters or {}
    request, _ = parse_body(url, body, defaults)
    model = resolve_model_name(request.model, served_model_names + list(adapters))
    prompts, params = endpoint.inputs(request, engine, parsers)
    rendering = endpoint.rendering(request, model, request_id, engine.tokenizer, parsers, prompts, params)
    return PreparedRequest(endpoint, rendering, prompts, params, request.priority, adapters.get(model),
                           getattr(request, "cache_salt", None))


def sampling_default_problems(sampling: dict) -> list[str]:
    """Why the job's `sampling` defaults would fail every request (unknown keys, bad values); [] if fine."""
    known = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)) - NOT_DEFAULTS
    problems = [f"'sampling.{key}' cannot be a job-wide default (each request body gives its own, and batch "
                "jobs do not stream)" for key in sampling if key in NOT_DEFAULTS]
    problems += [f"unknown key 'sampling.{key}'; valid keys here are: {', '.join(sorted(known))}"
                 for key in sampling if key not in known | NOT_DEFAULTS]
    if problems:
        return problems
    for url, endpoint in ENDPOINTS.items():
        try:
            parse_body(url, endpoint.example_body, sampling)
        except APIError as exc:
            problem = f"sampling: {exc.message}"
            if problem not in problems:
                problems.append(problem)
    return problems
