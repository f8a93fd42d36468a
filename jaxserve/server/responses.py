"""POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
machinery (responses_protocol.py reads requests into chat requests and writes answers as output items).

Responses made with `store` (OpenAI's default) are kept in memory (response_store.py) for `previous_response_id`
conversations and retrieval.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.outputs import RequestOutput
from jaxserve.server.chat import ChatJob, ChoiceProgress, delta_choice, start_chat
from jaxserve.server.errors import APIError, bad_request, from_exception, parse_json
from jaxserve.server.request_bodies import parse_request
from jaxserve.server.response_events import ResponseEvents
from jaxserve.server.response_store import ResponseStore, StoredResponse
from jaxserve.server.responses_protocol import (
    ResponsesRequest,
    input_messages,
    new_id,
    output_items,
    response_body,
    usage,
)
from jaxserve.server.serving import (
    ServerState,
    aborted_before_finishing,
    close_all,
    collect_final_outputs,
    observed,
)
from jaxserve.server.streaming import EventStreamResponse, cancel_on_disconnect, sse_json


@dataclass
class ResponseJob:
    """One /v1/responses request on its way: the chat job that runs it and what its answer is recorded with."""

    request: ResponsesRequest
    chat: ChatJob
    conversation: list[dict[str, Any]]  # the chat messages it answers, without its instructions
    response_id: str
    created_at: float

    def body(self, output: list[dict[str, Any]], status: str, final: RequestOutput | None = None) -> dict[str, Any]:
        return response_body(self.response_id, self.chat.model, self.request, output, status=status,
                             created_at=self.created_at, usage=final and usage(final, self._reasoning_tokens(output)))

    def finished(self, output: list[dict[str, Any]], final: RequestOutput, store: ResponseStore) -> dict[str, Any]:
        """The whole response; kept in the store when the request asked for it."""
        reason = final.outputs[0].finish_reason
        body = self.body(output, "incomplete" if reason == "length" else "completed", final)
        if self.request.stored:
            store.put(body, self.conversation + input_messages(output))  # output items read as the next input
        return body

    def _reasoning_tokens(self, output: list[dict[str, Any]]) -> int:
        text = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        return len(self.chat.tokenizer.encode(text, add_special_tokens=False)) if text else 0


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = parse_request(ResponsesRequest, await parse_json(request))
    history = []
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise bad_request(f"Previous response with id '{body.previous_response_id}' not found: it was made with "
                              "store false, deleted, or dropped to keep this server's store within its bounds (the "
                              f"latest {state.responses.capacity} responses), or the server restarted",
                              param="previous_response_id")
        history = previous.conversation
    chat, conversation = body.chat_request(history)
    response_id = new_id("resp")
    chat_job, streams = await start_chat(state, chat, response_id)
    job = ResponseJob(body, chat_job, conversation, response_id, time.time())
    if body.stream:
        return EventStreamResponse(_sse(_events(job, state)), on_close=lambda: close_all(streams))
    completed, finals = await cancel_on_disconnect(request, collect_final_outputs(state, streams,
                                                                                  chat_job.arrival_time))
    if not completed:
        return Response(status_code=499)  # the client left; nobody reads this
    final = finals[0]
    message, reason = chat_job.message(final.outputs[0])
    return JSONResponse(job.finished(output_items(message, reason, chat_job.calls_whole), final, state.responses))


async def _events(job: ResponseJob, state: ServerState) -> AsyncIterator[dict[str, Any]]:
    """The stream's events; a failure once it has begun (a timeout, an engine failure, an abort) ends it with
    `response.failed`, the response so far (the item cut short closed as incomplete) with status "failed" and the
    error, as OpenAI ends a failed one (and keeps it, when stored)."""
    events = ResponseEvents(calls_whole=job.chat.calls_whole)
    yield events.event("response.created", response=job.body([], "in_progress"))
    try:
        async for event in _answer_events(job, state, events):
            yield event
    except Exception as exc:  # noqa: BLE001 - headers are sent: the stream is the only way left to report it
        error = from_exception(exc).body()["error"]
        for event in events.close("incomplete"):  # the item cut short, done with its text so far
            yield event
        failed = {**job.body(events.items, "failed"),
                  "error": {"code": error.get("code") or "server_error", "message": error["message"]}}
        if job.request.stored:  # the client has its id from response.created: GET answers with the failure
            state.responses.put(failed, job.conversation + (input_messages(events.items) if events.items else []))
        yield events.event("response.failed", response=failed)


async def _answer_events(job: ResponseJob, state: ServerState, events: ResponseEvents
                         ) -> AsyncIterator[dict[str, Any]]:
    yield events.event("response.in_progress", response=job.body([], "in_progress"))
    progress: dict[int, ChoiceProgress] = {}
    final = None
    async with aclosing(observed(state, [job.chat.stream], job.chat.arrival_time)) as outputs:
        async for _, output in outputs:
            final = output
            choice = delta_choice(job.chat, output.outputs[0], progress)
            for event in events.delta(choice.delta) if choice is not None else ():
                yield event
    if final is None or not final.finished:
        raise aborted_before_finishing()
    status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
    for event in events.finish(status):
        yield event
    yield events.event(f"response.{status}", response=job.finished(events.items, final, state.responses))


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """`event: <type>` and `data: {json}` per event, as OpenAI sends them (no [DONE]); a failure `_events` did not
    report becomes an "error" event."""
    sequence_number = 0
    try:
        async for event in events:
            sequence_number = event["sequence_number"] + 1
            yield f"event: {event['type']}\ndata: {sse_json(event)}\n\n"
    except Exception as exc:  # noqa: BLE001 - headers are sent: the only way left to report is in the stream
        error = from_exception(exc).body()["error"]
        event = {"type": "error", "sequence_number": sequence_number, "code": error.get("code"),
                 "message": error["message"], "param": error.get("param")}
        yield f"event: error\ndata: {sse_json(event)}\n\n"
    finally:
        await events.aclose()


def _stored(request: Request) -> tuple[ServerState, str, StoredResponse]:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                       param="response_id", code="response_not_found")
    return state, response_id, stored


async def retrieve_response(request: Request) -> JSONResponse:
    _, _, stored = _stored(request)
    return JSONResponse(stored.body)


async def delete_response(request: Request) -> JSONResponse:
    state, response_id, _ = _stored(request)
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
