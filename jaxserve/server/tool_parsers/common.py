"""What the tool-call parsers share: holding back a marker's beginning, and a call out of a decoded JSON object."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.tools import ToolCall

JSON_BLANKS = " \t\n\r"  # JSON's whitespace: str.strip() alone would take Unicode spaces JSON does not allow


class RequestIndependent:
    """A parser that reads every request alike: `for_tools` (the parser for a request's tools) is the parser."""

    def for_tools(self, tools: list[dict] | None):
        return self


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_from_object(value: Any, call_id: str | None = None, *, marked: bool = False) -> ToolCall | None:
    """A call out of `{"name": ..., "arguments": {...}}` (Llama 3 writes "parameters"); None for anything else.
    Arguments already given as JSON text are kept as they are. Only where a marker says a call follows
    (`marked`: hermes' <tool_call> tags, Mistral's [TOOL_CALLS]) may the arguments be left out (no arguments):
    in a bare JSON reply, an object with a "name" and no arguments is an answer (a person's record asked for by
    response_format, say), as vLLM reads it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if not marked and "arguments" not in value and "parameters" not in value:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # already JSON text: kept as written, if it is an object's
        decoded = decode_json_at(arguments.strip(JSON_BLANKS), 0)
        whole = decoded is not None and decoded[1] == len(arguments.strip(JSON_BLANKS))
        return ToolCall(value["name"], arguments, call_id) if whole and isinstance(decoded[0], dict) else None
    text = arguments_json(arguments) if isinstance(arguments, dict) else None
    return None if text is None else ToolCall(value["name"], text, call_id)


def arguments_json(arguments: dict) -> str | None:
    """The arguments as strict JSON text, or None where they have none (NaN or Infinity, which Python's json
    reads and writes but no other JSON parser takes)."""
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(the JSON value that starts at `pos`, where it ends), or None where none is complete there. Nesting too
    deep for the decoder (a model can write a thousand "[" in a few hundred tokens), or a number too long for Python
    to read (over 4300 digits: a ValueError), is no JSON either."""
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None
