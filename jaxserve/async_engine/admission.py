"""Which requests an AsyncEngine has admitted: the ids in flight (unique, and what a graceful drain waits for) and
how many wait for their first output (what a full queue counts). Both sides of the AsyncEngine change them, so
every change holds one lock."""

from __future__ import annotations

import threading

from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.errors import QueueFull


class Admission:
    def __init__(self, max_waiting_requests: int):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._num_waiting = 0

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._num_waiting

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._in_flight

    def admit(self, request_id: str, bounded: bool = True) -> None:
        """Count a new request in flight and waiting; `bounded`: refused with QueueFull when too many wait."""
        with self._lock:
            self._check_unused(request_id)
            if bounded and self._num_waiting >= self.max_waiting_requests:
                raise QueueFull(self._num_waiting, self.max_waiting_requests)
            self._in_flight.add(request_id)
            self._num_waiting += 1

    def withdraw(self, request_id: str) -> None:
        """Undo `admit` for a request that failed before it was queued."""
        with self._lock:
            self._in_flight.discard(request_id)
            self._num_waiting -= 1

    def started(self, stream: RequestStream) -> None:
        """The request's first output (or its end) reached its stream: it no longer waits."""
        with self._lock:
            if stream.waiting_for_first_output:
                stream.waiting_for_first_output = False
                self._num_waiting -= 1

    def track(self, request_id: str) -> None:
        """Count work made of several requests (a beam search) in flight from start to end, so that a graceful
        shutdown waits for it between its requests too; `done` when it ends."""
        with self._lock:
            self._check_unused(request_id)
            self._in_flight.add(request_id)

    def done(self, request_id: str) -> None:
        """The request's consumer has seen its end (or stopped reading)."""
        with self._lock:
            self._in_flight.discard(request_id)

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in use")
