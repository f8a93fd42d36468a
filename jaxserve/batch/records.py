"""Output lines, in OpenAI's batch output format:

    {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": {"code", "message", ...}}

A finished request has a 200 response whose body is exactly the HTTP API's; a request the API would refuse has the
API's status and error body plus `error`; a line that is not a request at all has only `error` (with its `line`).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from jaxserve.batch.input_file import BadLine, ResultKey
from jaxserve.server.errors import APIError


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchError(BaseModel):
    """OpenAI's batch error object (the same fields as its `errors.data[]`)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchOutputLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    custom_id: str | None
    response: BatchResponse | None = None
    error: BatchError | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.response is None or self.response.status_code != 200

    @property
    def key(self) -> ResultKey | None:
        """Which input line this answers (see input_file.ResultKey); None if it cannot tell."""
        if self.custom_id is not None:
            return self.custom_id
        return self.error.line if self.error is not None else None


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def succeeded(custom_id: str, request_id: str, body: dict[str, Any]) -> BatchOutputLine:
    return BatchOutputLine(id=_record_id(), custom_id=custom_id,
                           response=BatchResponse(status_code=200, request_id=request_id, body=body))


def refused(custom_id: str, request_id: str, error: APIError) -> BatchOutputLine:
    """A request the HTTP API would answer with an error: the same status and body, and `error` set."""
    response = BatchResponse(status_code=error.status, request_id=request_id, body=error.body())
    code = str(error.code) if error.code is not None else error.type
    return BatchOutputLine(id=_record_id(), custom_id=custom_id, response=response,
                           error=BatchError(code=code, message=error.message, param=error.param))


def bad_line(entry: BadLine) -> BatchOutputLine:
    error = BatchError(code="invalid_request_line", message=entry.message, line=entry.line)
    return BatchOutputLine(id=_record_id(), custom_id=entry.custom_id, error=error)
