"""What the completion and chat handlers share: server state, starting requests, collecting their outputs."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from jaxserve.async_engine.beam_search_stream import BeamSearchStream
from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.reasoning_parsers import ReasoningParser
from jaxserve.server.request_bodies import resolve_model_name, with_cache_salt
from jaxserve.server.response_bodies import OutputOptions
from jaxserve.server.response_store import ResponseStore
from jaxserve.server.streaming import merge_streams
from jaxserve.server.tool_parsers import ToolParser


@dataclass
class ServerState:
    """Everything a route needs; the server reaches the model only through `engine`."""

    engine: AsyncEngine
    served_model_names: list[str]
    metrics: ServerMetrics
    default_chat_template_kwargs: dict | None = None  # --default-chat-template-kwargs; a request's own win
    tool_parser: ToolParser | None = None  # --tool-call-parser with --enable-auto-tool-choice: tool_choice "auto"
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser: `reasoning` apart from `content`
    # --lora-modules: a request whose `model` names one runs with that adapter (vLLM's convention)
    lora_adapters: dict[str, LoRARequest] = field(default_factory=dict)
    runtime_lora_updating: bool = False  # --enable-runtime-lora-updating: adapters loaded and unloaded over HTTP
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses made with store
    output_options: OutputOptions = field(default_factory=OutputOptions)  # what bodies carry beyond OpenAI's
    started_at: float = field(default_factory=time.time)

    def __post_init__(self):
        # Ids only grow: an adapter loaded again gets a new one, so none of its old KV blocks match (cache_root).
        self._lora_ids = itertools.count(max((lora.lora_int_id for lora in self.lora_adapters.values()), default=0) + 1)

    def next_lora_id(self) -> int:
        return next(self._lora_ids)

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; a 404 for a model (or adapter) this server does not serve."""
        return resolve_model_name(requested, self.served_model_names + list(self.lora_adapters))

    def lora_for(self, model: str) -> LoRARequest | None:
        """The adapter a resolved model name runs with (None: the base model)."""
        return self.lora_adapters.get(model)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)


def request_ids(prefix: str, headers, named: str | None) -> tuple[str, str]:
    """The response's id and the engine's, as vLLM names them: a client names a request by its X-Request-Id
    header or the body's `request_id` (the header wins), and the response answers `<prefix>-<name>`. A name may
    come again while its first request runs (a retry, a gateway's id): the engine's id adds a random suffix to a
    named one, so two requests never share one and the second is not refused."""
    named = headers.get("x-request-id") or named
    if not named:
        fresh = f"{prefix}-{uuid.uuid4().hex}"
        return fresh, fresh
    return f"{prefix}-{named}", f"{prefix}-{named}-{uuid.uuid4().hex[:8]}"


async def start_requests(state: ServerState, prompts: list[str | list[int]],
                         params: SamplingParams | BeamSearchParams, request_id: str, priority: int, model: str,
                         cache_salt: str | None = None) -> list[RequestStream | BeamSearchStream]:
    """Queue one engine request (or beam search) per prompt (with the adapter `model` names, if it names one);
    if any is refused, abort those already queued and re-raise. `cache_salt`: vLLM's request field (the prefix
    cache is shared only between requests with the same salt; beam searches take none)."""
    streams: list[RequestStream | BeamSearchStream] = []
    lora = state.lora_for(model)
    try:
        for index, prompt in enumerate(prompts):
            sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            if isinstance(params, BeamSearchParams):
                streams.append(await state.engine.beam_search(prompt, params, sub_id, priority, lora_request=lora))
                continue
            streams.append(await state.engine.add_request(with_cache_salt(prompt, cache_salt), params.clone(), sub_id,
                                                          priority=priority, lora_request=lora))
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: list[RequestStream]) -> None:
    """Abort whichever of the streams has not finished (a no-op for finished ones)."""
    for stream in streams:
        stream.close()


def observed(state: ServerState, streams: list[RequestStream], arrival_time: float
             ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all streams as they arrive, tagged with the prompt index, with metrics recorded."""
    return merge_streams([state.metrics.observe(stream, arrival_time) for stream in streams])


async def collect_final_outputs(state: ServerState, streams: list[RequestStream], arrival_time: float
                                ) -> list[RequestOutput]:
    """Wait for every request to finish; returns each one's final output, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(observed(state, streams, arrival_time)) as outputs:
            async for index, output in outputs:
                finals[index] = output
    finally:
        close_all(streams)
    if any(output is None or not output.finished for output in finals):
        raise aborted_before_finishing()
    return finals


def aborted_before_finishing() -> APIError:
    """A request's outputs ended without a finished one (aborted by the engine or a shutdown)."""
    return APIError(500, "The request was aborted before it finished", "server_error", code="aborted")
