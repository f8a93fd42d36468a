"""POST /v1/chat/completions: messages through the model's chat template, answers whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.outputs import CompletionOutput
from jaxserve.server.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from jaxserve.server.errors import parse_json
from jaxserve.server.protocol import choice_usage
from jaxserve.server.request_bodies import chat_inputs, parse_request
from jaxserve.server.response_bodies import ChatRendering
from jaxserve.server.serving import (
    ServerState,
    close_all,
    collect_final_outputs,
    observed,
    request_ids,
    start_requests,
)
from jaxserve.server.streaming import EventStreamResponse, cancel_on_disconnect, sse_events
from jaxserve.server.tools import ToolCall


@dataclass(kw_only=True)
class ChatJob(ChatRendering):
    state: ServerState
    arrival_time: float
    stream: RequestStream


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = parse_request(ChatCompletionRequest, await parse_json(request))
    job, streams = await start_chat(state, body, *request_ids("chatcmpl", request.headers, body.request_id))
    if body.stream:
        return EventStreamResponse(sse_events(_stream_chunks(job)), on_close=lambda: close_all(streams))
    completed, finals = await cancel_on_disconnect(request, collect_final_outputs(state, streams, job.arrival_time))
    if not completed:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(job.full_response(finals[0]).model_dump())


async def start_chat(state: ServerState, body: ChatCompletionRequest, response_id: str, engine_id: str | None = None
                     ) -> tuple[ChatJob, list[RequestStream]]:
    """Render the conversation and queue its request (also how /v1/responses runs); the engine runs it as
    `engine_id` (by default the response's id)."""
    model = state.resolve_model(body.model)
    # Rendering a long conversation through the template is CPU work: keep it off the event loop.
    prompts, params = await asyncio.to_thread(chat_inputs, body, state.engine.encode_chat,
                                              state.engine.generation_defaults, state.default_chat_template_kwargs,
                                              state.tool_parser, state.reasoning_parser)
    reasoning = state.reasoning_parser and state.reasoning_parser.bind(prompts[0], params)
    arrival_time = time.monotonic()
    streams = await start_requests(state, prompts, params, engine_id or response_id, body.priority, model,
                                   body.cache_salt)
    try:
        job = ChatJob(body, model, response_id, state.engine.tokenizer, state.tool_parser, reasoning,
                      state.output_options, state=state, arrival_time=arrival_time, stream=streams[0])
    except BaseException:  # no one would read the requests: stop them
        close_all(streams)
        raise
    return job, streams


async def _stream_chunks(job: ChatJob) -> AsyncIterator[ChatCompletionStreamResponse]:
    progress: dict[int, ChoiceProgress] = {}  # per choice index
    last_output = None
    send_prompt_ids = bool(job.request.return_token_ids)  # vLLM's: in the first chunk
    async with aclosing(observed(job.state, [job.stream], job.arrival_time)) as outputs:
        async for _, output in outputs:
            last_output = output
            for completion in output.outputs:
                choice = delta_choice(job, completion, progress)
                if choice is not None:
                    usage = choice_usage(output, completion) if job.options.usage_in_every_chunk(job.request) else None
                    yield ChatCompletionStreamResponse(
                        id=job.request_id, model=job.model, choices=[choice], usage=usage, created=job.created,
                        prompt_token_ids=output.prompt_token_ids if send_prompt_ids else None)
                    send_prompt_ids = False
    if job.options.usage_chunk(job.request) and last_output is not None:
        yield ChatCompletionStreamResponse(id=job.request_id, model=job.model, choices=[], created=job.created,
                                           usage=job.options.usage([last_output]))


@dataclass
class ChoiceProgress:
    """What one choice's chunks have sent so far."""

    chars: int = 0  # of the answer (with tools under "auto": of the content outside the tool calls)
    reasoning_chars: int = 0  # of the reasoning, with a reasoning parser
    tokens: int = 0
    calls: int = 0  # tool calls, under "auto"
    finished: bool = False


def delta_choice(job: ChatJob, completion: CompletionOutput, progress: dict[int, ChoiceProgress]
                  ) -> ChatStreamChoice | None:
    """The new part of one choice since its last chunk (the first one also names the role), or None."""
    choice = job.tool_choice
    if choice is not None and choice.kind == "required" and not completion.finished:
        return None  # "required": the calls are parsed from the whole text, in the last chunk
    first_chunk = completion.index not in progress
    sent = progress.setdefault(completion.index, ChoiceProgress())
    if sent.finished:
        return None
    tokens_sent = sent.tokens
    delta, finish_reason = _delta(job, completion, sent, first_chunk)
    # Tokens whose text is held back (a possible stop string, a tool call being written) send a chunk only to
    # carry their logprobs.
    carries_logprobs = job.sends_logprobs and len(completion.token_ids) > tokens_sent
    if delta is None and not completion.finished and not carries_logprobs:
        return None
    sent.tokens, sent.finished = len(completion.token_ids), completion.finished
    return ChatStreamChoice(index=completion.index, delta=delta or DeltaMessage(content=""),
                            logprobs=job.logprobs(completion, tokens_sent), finish_reason=finish_reason,
                            stop_reason=completion.stop_reason, token_ids=job.token_ids(completion, tokens_sent))


def _delta(job: ChatJob, completion: CompletionOutput, sent: ChoiceProgress, first_chunk: bool
           ) -> tuple[DeltaMessage | None, str | None]:
    """The message delta (None when there is nothing new to say) and the finish reason, by tool choice."""
    role = job.options.role(job.request) if first_chunk else None
    choice, reason = job.tool_choice, completion.finish_reason
    if choice is None:
        reasoning, text = _new_answer(job, completion, sent)
        if first_chunk:  # vLLM's echo: the message the reply goes on from, first
            text = job.request.echoed() + text
        if not (text or reasoning or first_chunk):
            return None, reason
        return DeltaMessage(role=role, content=text if text or not reasoning else None, reasoning=reasoning), reason
    if choice.kind == "required":
        message, reason = job.message(completion)
        calls = [{"index": i, **call} for i, call in enumerate(message.tool_calls)]
        return DeltaMessage(role=role, content=message.content, reasoning=message.reasoning,
                            tool_calls=calls or None), reason
    if choice.kind == "named":  # the function's arguments stream as they are generated (after any reasoning)
        reasoning, text = _new_answer(job, completion, sent)
        if not (text or reasoning or first_chunk):
            return None, reason
        call = ToolCall(choice.name, text).body(0) if first_chunk else {"index": 0, "function": {"arguments": text}}
        return DeltaMessage(role=role, reasoning=reasoning, tool_calls=[call] if text or first_chunk else None), reason
    return _auto_delta(job, completion, sent, role)


def _auto_delta(job: ChatJob, completion: CompletionOutput, sent: ChoiceProgress, role: str | None
                ) -> tuple[DeltaMessage | None, str | None]:
    """tool_choice "auto": content as it becomes final (text that may open a tool call is held back), each tool
    call whole once its block closes; reasoning before them as it comes."""
    reasoning, answer = _new_reasoning(job, completion, sent)
    content, calls = job.tool_parser.split(answer, final=completion.finished)
    calls = job.tool_choice.kept_calls(calls)
    text, new_calls = content[sent.chars:], calls[sent.calls:]
    first_index, sent.chars, sent.calls = sent.calls, len(content), len(calls)
    reason = completion.finish_reason
    if calls and reason == "stop":  # as in message(): a length cut stays "length"
        reason = "tool_calls"
    bodies = [call.body(first_index + i) for i, call in enumerate(new_calls)]
    if not text and not bodies and not reasoning and role is None:
        return None, reason
    # The first chunk names the role with content "" (as vLLM's does) unless it already carries a call or reasoning.
    return DeltaMessage(role=role, content=text or (None if bodies or reasoning else ""), reasoning=reasoning,
                        tool_calls=bodies or None), reason


def _new_answer(job: ChatJob, completion: CompletionOutput, sent: ChoiceProgress) -> tuple[str | None, str]:
    """The reasoning and the answer text not sent yet (reasoning None when there is none new)."""
    reasoning, answer = _new_reasoning(job, completion, sent)
    text, sent.chars = answer[sent.chars:], len(answer)
    return reasoning, text


def _new_reasoning(job: ChatJob, completion: CompletionOutput, sent: ChoiceProgress) -> tuple[str | None, str]:
    """The reasoning not sent yet (None when there is none new), and the answer's text so far."""
    reasoning, answer = job.answer(completion, final=completion.finished)
    if reasoning is None:
        return None, answer
    new, sent.reasoning_chars = reasoning[sent.reasoning_chars:], len(reasoning)
    return new or None, answer
