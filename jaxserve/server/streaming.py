"""Server-sent events as OpenAI clients parse them, and the plumbing around client disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxserve.server.errors import from_exception

T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"
_PUMP_FINISHED = object()


# Characters that str.splitlines() breaks lines at besides CR and LF (JSON escapes the other ones, below U+0020):
# left raw in generated text they would split an event for a client that reads the stream that way.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: Any) -> str:
    """JSON for one `data:` line: UTF-8 as it is, but never a character any client could read as a line break."""
    return json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)


def sse_event(payload: BaseModel | dict) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {sse_json(data)}\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data: {json}` per chunk, then `data: [DONE]`; a failure mid-stream becomes an error event before it."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except Exception as exc:  # noqa: BLE001 - headers are sent: the only way left to report is in the stream
        yield sse_event(from_exception(exc).body())
    finally:
        await chunks.aclose()
    yield DONE_EVENT


class EventStreamResponse(StreamingResponse):
    """A streaming response that, however it ends, closes its events and calls `on_close`.

    Starlette cancels the sending task when the client disconnects, which can leave the event generator suspended
    at a `yield` (or never started); `on_close` aborts the engine requests behind the stream at once, rather than
    whenever the generator is collected.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            await self.body_iterator.aclose()


async def merge_streams(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they arrive, tagged with the iterator's index."""
    interleaved = _interleave(iterators) if len(iterators) > 1 else None
    try:
        if interleaved is None:
            async for item in iterators[0]:
                yield 0, item
        else:
            async for tagged in interleaved:
                yield tagged
    finally:
        # Stop the pumps first, then close the sources now (running their `finally` blocks) rather than
        # whenever they are collected.
        if interleaved is not None:
            await interleaved.aclose()
        for iterator in iterators:
            if hasattr(iterator, "aclose"):
                await iterator.aclose()


async def _interleave(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await arrivals.put((index, item, None))
            await arrivals.put((index, _PUMP_FINISHED, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await arrivals.put((index, None, exc))

    pumps = [asyncio.create_task(pump(i, iterator)) for i, iterator in enumerate(iterators)]
    try:
        running = len(pumps)
        while running:
            index, item, error = await arrivals.get()
            if error is not None:
                raise error
            if item is _PUMP_FINISHED:
                running -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> tuple[bool, Any]:
    """Run `work` unless the client goes away first. Returns (completed, result).

    Non-streaming requests need this: nothing else notices that nobody waits for the answer any more, and the
    request would keep its KV blocks until it finished.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            # Let the work's own `finally` blocks run (they abort its requests) before answering.
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        return False, None
    return True, work_task.result()  # re-raises what the work raised
