"""Stopping a batch job on a signal at a step boundary, so every result finished by then is saved.

SIGTERM (a scheduler's) and Ctrl-C ask the job to stop after the step in flight; a second Ctrl-C stops at once.
Never mid-step by default: on several processes that would leave the followers inside the step's collectives.
Repeated SIGTERMs are ignored, since one stop request reaches process 0 from every follower that got a signal.
While a single process loads the model there is no step to wait for: a stop then ends the job at once (loading
and compiling a large model takes minutes, past a scheduler's grace period).
"""

from __future__ import annotations

import contextlib
import logging
import signal

log = logging.getLogger("jaxserve.batch")


class JobInterrupted(Exception):
    """The job stopped on request, between steps."""


class StopSignals:
    """`with StopSignals() as stop:` ... `stop.check()` raises JobInterrupted once a stop was asked for."""

    def __init__(self):
        self.requested = False
        self._at_once = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        if self.requested:
            raise JobInterrupted

    @contextlib.contextmanager
    def at_once(self):
        """Within: a stop asked for ends the job now (a single process loading its model: nothing to finish)."""
        self.check()
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.requested = True
        if self._at_once:
            log.warning("%s: stopping now (the model was loading; nothing had run)", signal.Signals(signum).name)
            raise JobInterrupted
        log.warning("%s: stopping after the step in flight%s", signal.Signals(signum).name,
                    " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "")
