"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, and the status of each failure."""

from __future__ import annotations

import json
import logging
import re

import pydantic
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.errors import EngineDeadError, EngineShuttingDown, InvalidRequestField, QueueFull, RequestTimedOut
from jaxserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Seconds a client is told to wait before retrying when the queue is full.
RETRY_AFTER_SECONDS = 1
# OpenAI's SDKs retry every 5xx twice unless the server says otherwise with this (non-standard) header. A request
# that ran past --request-timeout would only run past it again, tripling the load it already put on the server.
DO_NOT_RETRY = {"x-should-retry": "false"}
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff); paired ones are fine, lone ones are not text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class APIError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code="invalid_value" if param else None)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", param="model",
                    code="model_not_found")


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
                    "invalid_request_error", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-body-bytes)", "invalid_request_error", code="request_too_large")


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """A 400 naming the first offending field (never FastAPI's 422)."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    # Our own validators raise ValueError("field must ..."): that sentence already names the field.
    detail = first["msg"].removeprefix("Value error, ")
    message = detail if first["type"] == "value_error" or not param else f"{param}: {detail}"
    if len(exc.errors()) > 1:
        message += f" (and {len(exc.errors()) - 1} more problems)"
    return bad_request(message, param=param)


def from_exception(exc: Exception) -> APIError:
    """Map a failure raised while serving a request to what the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, pydantic.ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, ValueError):  # one refused below the server may know its request field
        return bad_request(str(exc), param=exc.param if isinstance(exc, InvalidRequestField) else None)
    if isinstance(exc, QueueFull):
        return APIError(503, str(exc), "server_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(exc, RequestTimedOut):
        return APIError(504, str(exc), "server_error", code="request_timeout", headers=DO_NOT_RETRY)
    if isinstance(exc, EngineShuttingDown):
        return APIError(503, str(exc), "server_error", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), "server_error", code="engine_dead")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {exc!r}", "server_error")


async def parse_json(request: Request) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = decode_json(await request.body(), "The request body")
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    return body


def decode_json(raw: bytes, what: str):
    """`raw` decoded as JSON that every later step can read, or a ValueError saying what is wrong with `what` (a
    request body, a batch line): the same rules over HTTP and in batch jobs."""
    try:
        value = json.loads(raw)
        # Python's json decodes a lone "\ud800" into a str that tokenizers and encoders then fail on deep inside.
        lone_surrogate = _SURROGATE_ESCAPE.search(raw) is not None and _has_lone_surrogate(value)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} nests JSON arrays or objects too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"{what} cannot be read as JSON: {exc}") from None
    if lone_surrogate:
        raise ValueError(f"{what} has a string with an unpaired UTF-16 surrogate escape (\\ud800 to \\udfff), which "
                         "is not valid Unicode text")
    return value


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(key) or _has_lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    return False


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc).response()


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    # The client left before sending its whole body: nothing to log, and nobody will read this answer.
    return Response(status_code=499)


async def handle_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    # Unknown routes and wrong methods answer in the same shape as every other error.
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", error_type,
                    headers=exc.headers).response()
