"""RequestStream: the outputs of one request, handed from the engine's loop thread to an asyncio consumer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from jaxserve.outputs import RequestOutput

# Put on a stream when it ends without a finished output (the request was aborted from elsewhere).
END_OF_STREAM = object()


class RequestStream:
    """The outputs of one request, in order. Iterate with `async for`; `close()` aborts it if unfinished.

    Created on the consumer's event loop; `push` is the only method the loop thread calls.
    """

    def __init__(self, request_id: str, on_done: Callable[[str, bool], None]):
        self.request_id = request_id
        self._on_done = on_done  # (request_id, still_running): releases the id, aborts a running request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self._deadline: asyncio.TimerHandle | None = None
        self.waiting_for_first_output = True  # admission bookkeeping, kept by the AsyncEngine under its lock

    def push(self, item: Any) -> None:
        """Hand an output, an exception or END_OF_STREAM to the consumer's event loop (thread-safe)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is END_OF_STREAM:
            self._finish(still_running=False)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._finish(still_running=False)
            raise item
        if item.finished:
            self._finish(still_running=False)
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def expire_after(self, seconds: float, on_expiry: Callable[["RequestStream"], None]) -> None:
        """Call `on_expiry(self)` on the consumer's loop after `seconds`, unless the stream has ended by then."""
        self._deadline = self._loop.call_later(seconds, on_expiry, self)

    def close(self) -> None:
        """Stop listening; an unfinished request is aborted so that its KV blocks are freed."""
        if not self._done:
            self._finish(still_running=True)

    def _finish(self, still_running: bool) -> None:
        self._done = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._on_done(self.request_id, still_running)
