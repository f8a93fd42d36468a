"""The errors users meet: a mistake they can fix (UserError, one line at the command line), and why the
AsyncEngine refused or ended a request (the server maps each to its HTTP status: server/errors.py)."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2, no traceback."""


class InvalidRequestField(ValueError):
    """A request field refused below the server, where only the model or the grammar compiler can tell (a token
    id outside the vocabulary, an invalid schema); `param` names the field (None: not known), as the HTTP 400's
    error body does (server/errors.py)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """Too many requests are waiting for their first token; the caller should retry later."""

    def __init__(self, num_waiting: int, limit: int):
        super().__init__(
            f"The server is overloaded: {num_waiting} requests are already waiting (limit {limit}); retry later"
        )
        self.num_waiting = num_waiting
        self.limit = limit


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step failed, or the engine shut down); no request can be served."""


class EngineShuttingDown(EngineDeadError):
    """The engine was asked to stop: in-flight requests are aborted, new ones refused."""


class RequestTimedOut(Exception):
    """The request ran past the server's per-request time limit and was aborted (its KV blocks are freed)."""

    def __init__(self, limit_seconds: float):
        super().__init__(f"The request did not finish within the server's time limit of {limit_seconds:g} s "
                         "(--request-timeout) and was aborted; ask for fewer tokens or retry later")
        self.limit_seconds = limit_seconds
