"""Constrained output: what a request's text must match (vLLM's `StructuredOutputsParams`, same field names).

Host-side only, no jax and no grammar library: this validates the request and nothing more. The grammar is
compiled by `core/grammar.py` when the request is prepared, so an invalid schema or regex is refused there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields: `json` (a JSON schema, dict or its JSON text), `regex`, `choice` (the output is
    one of these strings), `grammar` (Lark or GBNF text), or `json_object=True` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) if chosen else 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured outputs json_object must be true, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams | None:
        """From None, an instance, or a dict of its fields (a request body's `structured_outputs`)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {', '.join(unknown)}; it takes one of "
                             f"{', '.join(KINDS)}")
        return cls(**value)


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured outputs json is not valid JSON text: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured outputs json must be a JSON schema object, got {value!r}")
    return value
