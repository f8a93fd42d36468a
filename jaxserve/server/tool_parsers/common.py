"""What the tool-call parsers share: holding back a marker's beginning, and a call out of a decoded JSON object."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.tools import ToolCall


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_from_object(value: Any, call_id: str | None = None) -> ToolCall | None:
    """A call out of `{"name": ..., "arguments": {...}}` (Llama 3 writes "parameters"); None for anything else.
    Arguments already given as JSON text are kept as they are."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], arguments, call_id)


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(the JSON value that starts at `pos`, where it ends), or None where none is complete there."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError:
        return None
