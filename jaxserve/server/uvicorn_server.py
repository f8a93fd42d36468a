"""uvicorn with a shutdown that suits long generations.

On Ctrl-C or SIGTERM uvicorn stops accepting connections and waits for open ones; left alone it either waits
forever or, with a timeout, cancels the handlers mid-response (a traceback per request, clients cut off
without a word). Here requests get `drain_seconds` to finish; then the engine aborts the rest, which frees
their KV blocks and ends each with a proper error (an SSE error event and `[DONE]`, or a 503 body).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 10.0


class DrainingServer(uvicorn.Server):
    def __init__(self, app, async_engine, *, log_level: str = "info", drain_seconds: float = DEFAULT_DRAIN_SECONDS):
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=None))
        self.async_engine = async_engine
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        abort_the_rest = asyncio.get_running_loop().call_later(self.drain_seconds, self._abort_remaining)
        try:
            await super().shutdown(sockets)
        finally:
            abort_the_rest.cancel()

    def _abort_remaining(self) -> None:
        logger.warning("requests still running %.0f s after shutdown began: aborting them", self.drain_seconds)
        self.async_engine.stop()
