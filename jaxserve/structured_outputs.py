"""Constrained output: what a request's text must match (vLLM's `StructuredOutputsParams`, same field names).

Host-side only, no jax and no grammar library: this validates the request and nothing more. The grammar is
compiled by `grammar.py` when the request is prepared, so an invalid schema or regex is refused there.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints: `json` (a JSON schema, dict or its JSON text), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark or GBNF text), or `json_object=True` (any JSON object).
    `disable_additional_properties`: objects in the schema may hold only the properties they list (a server-wide
    setting in vLLM, per request here)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = False
    # vLLM's whitespace and backend options, accepted so its clients work, without effect: JSON is always generated
    # on one line, and there is one backend.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    # The request field it came from (e.g. "guided_regex"), so an invalid grammar is reported under that name.
    source: str | None = field(default=None, compare=False)
    # The grammar starts after the output's first occurrence of this token (a reasoning model's </think>, set by
    # the server's reasoning parser): the reasoning before it is free. None: from the first token.
    starts_after_token: int | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) if chosen else 'none'}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(f"structured outputs disable_additional_properties must be true or false, got "
                             f"{self.disable_additional_properties!r}")
        if self.json is not None:
            schema = _schema(self.json)
            if self.disable_additional_properties:
                schema = closed_objects(schema)
            object.__setattr__(self, "json", schema)
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

    @property
    def name(self) -> str:
        """How errors call it: the request field it came from, else e.g. "structured outputs regex"."""
        return self.source or f"structured outputs {self.kind}"

    @classmethod
    def of(cls, value: Any, source: str | None = None) -> StructuredOutputsParams | None:
        """From None, an instance, or a dict of its fields (a request body's `structured_outputs`)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)} - {"source", "starts_after_token"}  # set by the server, not clients
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields {', '.join(unknown)}; it takes one of "
                             f"{', '.join(KINDS)}, and options {', '.join(sorted(known - set(KINDS)))}")
        return cls(**value, source=source)


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured outputs json is not valid JSON text: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured outputs json must be a JSON schema object, got {value!r}")
    return value


def closed_objects(schema: dict) -> dict:
    """A copy of the schema in which every object that lists its properties and does not say otherwise has
    `additionalProperties: false` (as vLLM decides it; a bare {"type": "object"} stays free-form)."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                close(item)
        elif isinstance(node, dict):
            if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)

    close(schema)
    return schema
