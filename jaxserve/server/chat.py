"""POST /v1/chat/completions: messages through the model's chat template, answers whole or streamed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import CompletionOutput
from jaxserve.request_stream import RequestStream
from jaxserve.server.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from jaxserve.server.errors import parse_json
from jaxserve.server.protocol import UsageInfo
from jaxserve.server.request_bodies import chat_inputs, parse_request
from jaxserve.server.response_bodies import ChatRendering, completion_token_count
from jaxserve.server.serving import ServerState, close_all, collect_final_outputs, observed, start_requests
from jaxserve.server.streaming import EventStreamResponse, cancel_on_disconnect, sse_events
from jaxserve.server.tools import ToolCall


@dataclass
class ChatJob(ChatRendering):
    state: ServerState
    arrival_time: float
    stream: RequestStream


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = parse_request(ChatCompletionRequest, await parse_json(request))
    model = state.resolve_model(body.model)
    # Rendering a long conversation through the template is CPU work: keep it off the event loop.
    prompts, params = await asyncio.to_thread(chat_inputs, body, state.engine.encode_chat,
                                              state.engine.generation_defaults, state.default_chat_template_kwargs)
    arrival_time = time.monotonic()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(state, prompts, params, request_id, body.priority)
    job = ChatJob(body, model, request_id, state.engine.tokenizer, state, arrival_time, streams[0])
    if body.stream:
        return EventStreamResponse(sse_events(_stream_chunks(job)), on_close=lambda: close_all(streams))
    completed, finals = await cancel_on_disconnect(request, collect_final_outputs(state, streams, arrival_time))
    if not completed:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(job.full_response(finals[0]).model_dump())


async def _stream_chunks(job: ChatJob) -> AsyncIterator[ChatCompletionStreamResponse]:
    # Per choice index: (characters sent, tokens sent, finished).
    progress: dict[int, tuple[int, int, bool]] = {}
    last_output = None
    async with aclosing(observed(job.state, [job.stream], job.arrival_time)) as outputs:
        async for _, output in outputs:
            last_output = output
            for completion in output.outputs:
                choice = _delta_choice(job, completion, progress)
                if choice is not None:
                    yield ChatCompletionStreamResponse(id=job.request_id, model=job.model, choices=[choice])
    if job.request.include_usage_chunk and last_output is not None:
        usage = UsageInfo.of(len(last_output.prompt_token_ids), completion_token_count([last_output]))
        yield ChatCompletionStreamResponse(id=job.request_id, model=job.model, choices=[], usage=usage)


def _delta_choice(job: ChatJob, completion: CompletionOutput, progress: dict[int, tuple[int, int, bool]]
                  ) -> ChatStreamChoice | None:
    """The new part of one choice since its last chunk (the first one also names the role), or None."""
    first_chunk = completion.index not in progress
    chars_sent, tokens_sent, finished = progress.get(completion.index, (0, 0, False))
    mode = job.request.tool_mode()
    if finished or (mode == "required" and not completion.finished):  # calls are parsed from the whole text
        return None
    text = completion.text[chars_sent:]
    if not first_chunk and not text and len(completion.token_ids) <= tokens_sent and not completion.finished:
        return None
    progress[completion.index] = (len(completion.text), len(completion.token_ids), completion.finished)
    role = "assistant" if first_chunk else None
    finish_reason = completion.finish_reason
    if mode is None:
        delta = DeltaMessage(role=role, content=text)
    elif mode == "required":
        message, finish_reason = job.message(completion)
        calls = [{"index": i, **call} for i, call in enumerate(message.tool_calls)]
        delta = DeltaMessage(role=role, content=message.content, tool_calls=calls or None)
    else:  # a named function: its arguments stream as they are generated
        call = ToolCall(mode, text).body(0) if first_chunk else {"index": 0, "function": {"arguments": text}}
        delta = DeltaMessage(role=role, tool_calls=[call])
    return ChatStreamChoice(index=completion.index, delta=delta, logprobs=job.logprobs(completion, tokens_sent),
                            finish_reason=finish_reason, stop_reason=completion.stop_reason)
