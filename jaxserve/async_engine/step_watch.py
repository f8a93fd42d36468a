"""The engine loop's steps timed against `--step-timeout`: a step running longer marks the engine hung (health
answers 503), so a hung device, which neither fails nor returns, takes the server out of a load balancer's
rotation. A watchdog thread logs the overrun while the step still runs; the step logs it again if it returns."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

logger = logging.getLogger("jaxserve.async_engine.engine")  # the engine loop's logger, as before this module

# Warmed-up steps take milliseconds to a second; a compile-on-demand step (--no-warmup) takes seconds to a minute
# on a CPU.
DEFAULT_STEP_TIMEOUT_S = 180.0


class StepWatch:
    def __init__(self, timeout: float | None):
        """`timeout`: seconds a step may run (None: never hung, no watchdog thread)."""
        self.timeout = timeout
        self._started: float | None = None  # monotonic start of the step running now, if any
        # Set when the loop ends; the watchdog waits on it, so it ends with the loop. A daemon thread still running
        # at interpreter exit can be killed while it frees jax arrays, which aborts the process.
        self._loop_done = threading.Event()
        self._watchdog = None
        if timeout is not None:
            self._watchdog = threading.Thread(target=self._watch, name="jaxserve-step-watchdog", daemon=True)
            self._watchdog.start()

    @contextmanager
    def step(self):
        """Around one engine step (in the loop thread)."""
        self._started = started = time.monotonic()
        try:
            yield
        finally:
            self._started = None
        seconds = time.monotonic() - started
        if self.timeout is not None and seconds > self.timeout:
            logger.error("an engine step took %.1f s, over --step-timeout (%g s): /health answered 503 meanwhile",
                         seconds, self.timeout)

    @property
    def is_hung(self) -> bool:
        """Whether the current step has run longer than `timeout`."""
        started = self._started
        return self.timeout is not None and started is not None and time.monotonic() - started > self.timeout

    def loop_ended(self) -> None:
        self._loop_done.set()

    def join(self) -> None:
        """Wait for the watchdog, once the loop has ended (it wakes on that at once)."""
        if self._watchdog is not None and self._loop_done.is_set():
            self._watchdog.join()

    def _watch(self) -> None:
        """Log a step that overruns the timeout while it still runs: a hung device never returns to say so."""
        reported = None
        while not self._loop_done.wait(min(self.timeout / 4, 5.0)):
            started = self._started
            if started is not None and started != reported and self.is_hung:
                reported = started
                logger.error("an engine step has been running for over %g s (--step-timeout): /health answers "
                             "503 until it returns", self.timeout)
