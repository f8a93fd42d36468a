"""Constrained output: what a request's text must match (vLLM's `StructuredOutputsParams`, same field names).

Host-side only, no jax and no grammar library: this validates the request and nothing more. The grammar is
compiled by `grammar.py` when the request is prepared, so an invalid schema or regex is refused there.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM options about whitespace and backend fallback: accepted so its clients work, without effect (JSON is always
# generated on one line; there is one backend).
NO_EFFECT = ("disable_any_whitespace", "disable_fallback", "whitespace_pattern")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints: `json` (a JSON schema, dict or its JSON text), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark or GBNF text), or `json_object=True` (any JSON object).
    `disable_additional_properties`: objects in the schema may hold only the properties it lists (vLLM's)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = False
    # The request field it came from (e.g. "guided_regex"), so an invalid grammar is reported under that name.
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) if chosen else 'none'}")
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
        known = (*KINDS, "disable_additional_properties")
        unknown = sorted(set(value) - set(known) - set(NO_EFFECT))
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields {', '.join(unknown)}; it takes one of "
                             f"{', '.join(KINDS)}")
        return cls(**{k: v for k, v in value.items() if k in known}, source=source)


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
    """A copy of the schema in which every object that does not say otherwise has `additionalProperties: false`."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                close(item)
        elif isinstance(node, dict):
            if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)

    close(schema)
    return schema
