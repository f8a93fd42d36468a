"""uvicorn with a shutdown that suits long generations.

On Ctrl-C or SIGTERM uvicorn would close its listening socket and wait for open connections; left alone it
either waits forever or, with a timeout, cancels the handlers mid-response (a traceback per request, clients
cut off without a word). Here a shutdown goes:

1. stop admitting: new requests get 503 `shutting_down` and /health turns 503, while the socket stays open (a
   client is told why, rather than refused a connection);
2. let admitted requests finish, for up to `drain_seconds`;
3. abort whatever still runs: the engine frees their KV blocks and ends each with a proper error (an SSE error
   event and `[DONE]`, or a 503 body);
4. uvicorn's own shutdown: close the socket, give responses `FINAL_WRITE_SECONDS` to go out, stop the engine.

A second Ctrl-C skips the waiting. The process exits 0 after a SIGTERM as after a Ctrl-C: the drain is the
expected way to stop, not a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time

import uvicorn

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 10.0
# After the drain, how long responses still being written (the last SSE events) may take before uvicorn cuts them.
FINAL_WRITE_SECONDS = 5.0
_POLL_SECONDS = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, app, async_engine, *, log_level: str = "info", drain_seconds: float = DEFAULT_DRAIN_SECONDS,
                 **config_options):
        """`config_options`: more uvicorn.Config keywords (TLS: server/transport.ssl_options)."""
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=FINAL_WRITE_SECONDS,
                                        **config_options))
        self.async_engine = async_engine
        self.drain_seconds = drain_seconds

    async def shutdown(self, sockets=None) -> None:
        self.async_engine.stop_admitting()
        in_flight = self.async_engine.num_in_flight
        if in_flight:
            logger.info("shutting down: refusing new requests; waiting up to %g s for %d in flight",
                        self.drain_seconds, in_flight)
        if not await self._drained(deadline=time.monotonic() + self.drain_seconds):
            logger.warning("%d requests still running %g s after shutdown began: aborting them",
                           self.async_engine.num_in_flight, self.drain_seconds)
            self.async_engine.stop()
        await super().shutdown(sockets)

    async def _drained(self, deadline: float) -> bool:
        """Wait until no request is in flight (True) or until the deadline or a second Ctrl-C (False)."""
        while self.async_engine.num_in_flight:
            if self.force_exit or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_SECONDS)
        return True

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured SIGTERM once it has shut down; under the default handler that kills the
        # process (status -15) after a clean drain. A no-op handler meanwhile lets `run` return normally.
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGTERM, _already_handled)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def _already_handled(signum, frame) -> None:
    """uvicorn's replay of the SIGTERM it has already acted on."""
