"""`qwen3_coder` (vLLM's name): Qwen3-Coder's XML-style calls, one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text, so its JSON type comes from the request's tool schema (as vLLM reads it): text
for strings, a number for "integer"/"number", true/false for "boolean", JSON (or a Python literal) for objects
and arrays; "null" is null. Text before the first block is the content; a block that does not parse is content
as written, so nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from jaxserve.server.tool_parsers.common import arguments_json
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from jaxserve.server.tools import ToolCall

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
# A value ends at its </parameter>, or, where the model left that out, at the next parameter or the function's end.
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolParser(HermesToolParser):
    """Hermes' blocks (the content before the first, a malformed block kept as written, special tokens kept in the
    text, a possible `<tool_call>` beginning held back while streaming), holding XML-style calls."""

    def __init__(self, schemas: dict[str, dict] | None = None):
        self.schemas = schemas or {}  # function name -> its parameters' JSON schema (the request's tools)

    def for_tools(self, tools: list[dict] | None) -> Qwen3CoderToolParser:
        schemas = {}  # tools of the wrong shape (which tool_choice "none" does not check) type nothing
        for tool in tools or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("parameters"), dict):
                schemas[function.get("name")] = function["parameters"]
        return Qwen3CoderToolParser(schemas)

    def _block(self, text: str, pos: int, final: bool) -> tuple[int, ToolCall | None] | None:
        """(where the block opening at `pos` ends, its call or None when malformed), or None until it closes."""
        close = text.find(self.end, pos)
        if close < 0 and not final:
            return None
        block_end = len(text) if close < 0 else close + len(self.end)
        return block_end, self._call(text[pos + len(self.start): close if close >= 0 else len(text)])

    def _call(self, body: str) -> ToolCall | None:
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if _PARAMETER.sub("", inner).strip():  # text that is no parameter: not a call of this format
            return None
        properties = (self.schemas.get(name) or {}).get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments = {key.strip(): _typed(_value_text(value), properties.get(key.strip()))
                     for key, value in _PARAMETER.findall(inner)}
        text = arguments_json(arguments)
        return None if text is None else ToolCall(name, text)


def _value_text(raw: str) -> str:
    """The value as written between its tags, less the one line break the format puts on each side."""
    return raw.removeprefix("\n").removesuffix("\n")


_TYPE_NAMES = {"int": "integer", "float": "number", "bool": "boolean"}
# The order a value is tried in, as vLLM's: a type it does not read as is skipped, text is the last resort
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def _schema_types(schema: Any, depth: int = 0) -> set[str]:
    """The JSON types a schema allows: its `type`, its enum's or const's values' types, and those of its anyOf,
    oneOf and allOf branches (Pydantic writes Optional[int] as an anyOf), as vLLM reads them."""
    if not isinstance(schema, dict) or depth > 32:
        return set()
    kinds = schema.get("type")
    types = {_TYPE_NAMES.get(kind, kind) for kind in (kinds if isinstance(kinds, list) else [kinds])
             if isinstance(kind, str)}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
    for value in values + ([schema["const"]] if "const" in schema else []):
        types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) if isinstance(schema.get(key), list) else []:
            types |= _schema_types(branch, depth + 1)
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")


def _typed(value: str, schema: Any) -> Any:
    """The value as a type its schema allows, tried in vLLM's order (null, integer, number, boolean, object,
    array); text when the schema allows string first, names no type, or the text is of none of them."""
    types = _schema_types(schema)
    text = value.strip()
    for kind in (kind for kind in _TYPE_ORDER if kind in types):
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            typed = _or_text(value, lambda text: int(text.strip()))
        elif kind == "number":
            typed = _or_text(value, _number)
        elif kind == "boolean":
            typed = text.lower() == "true" if text.lower() in ("true", "false") else value
        elif kind in ("object", "array"):
            typed = _or_text(value, json.loads, ast.literal_eval)
            if not isinstance(typed, dict if kind == "object" else list):
                continue
        else:
            continue
        if typed is not value:
            return typed
    return value


def _number(text: str) -> int | float:
    number = float(text.strip())
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(text)  # JSON has no NaN or Infinity
    return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number


def _or_text(value: str, *readers) -> Any:
    for read in readers:
        try:
            return read(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value
