"""Problems found in a job file or its input, worded for people (docs/architecture.md: errors are for people)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from jaxserve.errors import UserError


class JobError(UserError):
    """The job cannot start. `problems` lists every one found; the message (one line) leads with the first."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = path
        self.problems = problems
        more = ""
        if len(problems) > 1:
            more = f" (and {len(problems) - 1} more; `jaxserve batch --validate` lists them all)"
        super().__init__(f"job file {path}: {problems[0]}{more}")


def describe_validation_error(error: dict[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error as a sentence naming the key, e.g. "unknown key 'engine.max_num_seq'; valid ..."."""
    location = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        parent = _model_at(root, error["loc"][:-1])
        valid = ", ".join(parent.model_fields) if parent is not None else "see the documentation"
        return f"unknown key {location!r}; valid keys here are: {valid}"
    if error["type"] == "missing":
        return f"`{location}` is required"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error":  # our own validators word the whole sentence
        return f"{location}: {message}"
    return f"{location}: {message}, got {error['input']!r}"


def _model_at(root: type[BaseModel], location: tuple) -> type[BaseModel] | None:
    """The model class found by following `location` (field names) down from `root`."""
    model = root
    for part in location:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model
