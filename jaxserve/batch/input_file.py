"""Reading the job's input: OpenAI batch JSONL, one `{"custom_id", "method", "url", "body"}` request a line.

A line that cannot be a request (not JSON, a missing custom_id, an unsupported url...) becomes a `BadLine` naming
its line number, and the job goes on without it; duplicate custom_ids are listed so the job can refuse to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, StringConstraints

from jaxserve.batch.endpoints import ENDPOINTS
from jaxserve.batch.problems import describe_validation_error
from jaxserve.server.errors import decode_json

# A result's key in the output: the custom_id, or the line number of a line that has no usable custom_id.
ResultKey = str | int


class BatchRequestLine(BaseModel):
    """One input line, as OpenAI's batch API defines it (other keys are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    custom_id: Annotated[str, StringConstraints(min_length=1)]
    method: Literal["POST"]
    url: Literal[tuple(ENDPOINTS)]  # type: ignore[valid-type]
    body: dict[str, Any]


@dataclass(frozen=True)
class InputItem:
    line: int
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def key(self) -> ResultKey:
        return self.custom_id

    @property
    def where(self) -> str:
        """How messages name this line."""
        return f"line {self.line} (custom_id {self.custom_id!r})"

    @property
    def origin(self) -> str:
        """How the ignored-fields warning names it (server/protocol.request_origin)."""
        return f" on {self.where}"


@dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None  # kept when the line had one, so its error record can name it
    message: str  # starts with "line N: "

    @property
    def key(self) -> ResultKey:
        return self.custom_id if self.custom_id is not None else self.line


@dataclass
class InputScan:
    items: list[InputItem] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # one sentence per repeated custom_id

    @property
    def entries(self) -> list[InputItem | BadLine]:
        """Every line that will get a result, in input order."""
        return sorted([*self.items, *self.bad_lines], key=lambda entry: entry.line)

    def count_by_url(self) -> dict[str, int]:
        """Requests per endpoint, in ENDPOINTS' order; endpoints no line calls are left out."""
        counts = dict.fromkeys(ENDPOINTS, 0)
        for item in self.items:
            counts[item.url] += 1
        return {url: count for url, count in counts.items() if count}


def scan_input(path: Path) -> InputScan:
    """Parse every line of the input file; blank lines are skipped."""
    scan = InputScan()
    first_line_of: dict[str, int] = {}
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            entry = parse_line(number, raw)
            (scan.items if isinstance(entry, InputItem) else scan.bad_lines).append(entry)
            if entry.custom_id is None:
                continue
            if entry.custom_id in first_line_of:
                scan.duplicates.append(f"custom_id {entry.custom_id!r} appears on lines "
                                       f"{first_line_of[entry.custom_id]} and {number}; each request needs its own")
            else:
                first_line_of[entry.custom_id] = number
    return scan


def parse_line(number: int, raw: bytes) -> InputItem | BadLine:
    try:
        data = decode_json(raw, f"line {number}")
    except ValueError as exc:  # not JSON, too deep, an unpaired surrogate: the HTTP server's 400s
        return BadLine(number, None, str(exc))
    if not isinstance(data, dict):
        return BadLine(number, None, f"line {number}: expected a JSON object with custom_id, method, url and body, "
                                     f"got {type(data).__name__}")
    custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) and data["custom_id"] else None
    try:
        line = BatchRequestLine.model_validate(data)
    except pydantic.ValidationError as exc:
        reason = describe_validation_error(exc.errors()[0], BatchRequestLine)
        return BadLine(number, custom_id, f"line {number}: {reason}")
    return InputItem(number, line.custom_id, line.url, line.body)
