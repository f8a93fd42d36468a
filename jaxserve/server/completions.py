"""POST /v1/completions: text (or token-id) prompts in, completions out, whole or streamed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.errors import parse_json
from jaxserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionStreamResponse,
    choice_usage,
)
from jaxserve.server.request_bodies import completion_inputs, parse_request
from jaxserve.server.response_bodies import (
    CompletionRendering,
    concat_logprobs,
    end_offset,
)
from jaxserve.server.serving import (
    ServerState,
    close_all,
    collect_final_outputs,
    observed,
    request_ids,
    start_requests,
)
from jaxserve.server.streaming import EventStreamResponse, cancel_on_disconnect, sse_events


@dataclass(kw_only=True)
class CompletionJob(CompletionRendering):
    """One validated completion request and the engine requests serving it (one per prompt)."""

    state: ServerState
    arrival_time: float
    streams: list[RequestStream]


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = parse_request(CompletionRequest, await parse_json(request))
    model = state.resolve_model(body.model)
    # Off the event loop: under add_special_tokens false the prompts are tokenized here.
    prompts, params = await asyncio.to_thread(completion_inputs, body, state.engine.generation_defaults,
                                              state.engine.tokenizer)
    arrival_time = time.monotonic()
    response_id, engine_id = request_ids("cmpl", request.headers, body.request_id)
    streams = await start_requests(state, prompts, params, engine_id, body.priority, model, body.cache_salt)
    job = CompletionJob(body, model, response_id, state.engine.tokenizer, state.output_options, state=state,
                        arrival_time=arrival_time, streams=streams)
    if body.stream:
        return EventStreamResponse(sse_events(_stream_chunks(job)), on_close=lambda: close_all(streams))
    completed, finals = await cancel_on_disconnect(
        request, collect_final_outputs(state, streams, arrival_time))
    if not completed:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(job.full_response(finals).model_dump())


@dataclass
class _ChoiceProgress:
    """What has been streamed of one choice so far."""

    chars_sent: int = 0
    tokens_sent: int = 0
    # Where the next token's text_offset is: after the echoed prompt and the tokens sent, held-back text included
    next_offset: int = 0
    finished: bool = False


async def _stream_chunks(job: CompletionJob) -> AsyncIterator[CompletionStreamResponse]:
    progress: dict[int, _ChoiceProgress] = {}
    last_outputs: dict[int, RequestOutput] = {}
    async with aclosing(observed(job.state, job.streams, job.arrival_time)) as outputs:
        async for prompt_index, output in outputs:
            output = job.shown(output)
            last_outputs[prompt_index] = output
            for completion in output.outputs:
                choice = _delta_choice(job, prompt_index, output, completion, progress)
                if choice is not None:
                    usage = choice_usage(output, completion) if job.options.usage_in_every_chunk(job.request) else None
                    yield CompletionStreamResponse(id=job.request_id, model=job.model, choices=[choice], usage=usage,
                                                   created=job.created)
    if job.options.usage_chunk(job.request):
        finals = list(last_outputs.values())
        yield CompletionStreamResponse(id=job.request_id, model=job.model, choices=[], usage=job.options.usage(finals),
                                       created=job.created)


def _delta_choice(job: CompletionJob, prompt_index: int, output: RequestOutput, completion: CompletionOutput,
                  progress: dict[int, _ChoiceProgress]) -> CompletionChoice | None:
    """The new part of one choice since the last chunk, or None when there is nothing new to say."""
    index = job.choice_index(prompt_index, completion)
    first_chunk = index not in progress
    sent = progress.setdefault(index, _ChoiceProgress())
    if sent.finished:
        return None
    text = completion.text[sent.chars_sent:]
    new_tokens = len(completion.token_ids) - sent.tokens_sent
    if not text and new_tokens <= 0 and not completion.finished:
        return None
    echo = first_chunk and job.request.echo
    prefix = job.prompt_text(output) if echo else ""
    logprobs = None
    if job.request.logprobs is not None:
        echoed = job.prompt_logprobs(output) if echo else None
        if echoed is not None:
            sent.next_offset = end_offset(echoed)
        logprobs = job.generated_logprobs(completion, sent.tokens_sent, sent.next_offset)
        if logprobs.tokens:
            sent.next_offset = end_offset(logprobs)
        if echoed is not None:
            logprobs = concat_logprobs(echoed, logprobs)
    ids = bool(job.request.return_token_ids)  # vLLM's: the prompt's in the first chunk, then each chunk's new ones
    new_ids = list(completion.token_ids[sent.tokens_sent:]) if ids else None
    sent.chars_sent, sent.tokens_sent = len(completion.text), len(completion.token_ids)
    sent.finished = completion.finished
    return CompletionChoice(index=index, text=prefix + text, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                            prompt_token_ids=output.prompt_token_ids if ids and first_chunk else None,
                            token_ids=new_ids)
