"""Tool calls, as vLLM produces them. Forced by `tool_choice`, through structured outputs, for any model:

- a named function (`{"type": "function", "function": {"name": "f"}}`): the output is f's arguments, constrained
  to its `parameters` JSON schema, and becomes one tool call;
- `"required"`: the output is a JSON array of `{"name": ..., "parameters": {...}}` objects, each constrained to
  one of the tools, and becomes one tool call per entry (finish_reason "tool_calls");
- `"none"`: no calls (the chat template still sees the tools, as in vLLM).

`"auto"` (OpenAI's default when tools are given) lets the model answer in text or call tools in its own format,
which `tool_parsers.py` parses out of the text; without a parser (`serve --tool-call-parser`) it is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str | None = field(default=None, compare=False)  # None: a new "call_..." id (a parser may need its own form)

    def body(self, index: int | None = None) -> dict[str, Any]:
        """The response's tool_calls entry (a stream delta's carries its index too)."""
        entry = {"id": self.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def function_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> JSON schema of its parameters; a ValueError naming `tools` for an entry of the wrong shape."""
    found = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                             f'...}}}}, got {tool!r}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r}")
        if name in found:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice: function names must be unique")
        parameters = function.get("parameters") or NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got {parameters!r}")
        found[name] = parameters
    return found


@dataclass(frozen=True)
class ToolChoice:
    """What a request's tools ask of the output: `kind` "auto" (the model decides, in its own format), "required"
    (one call or more, to any of the tools) or "named" (one call, to `name`). Without `parallel` (OpenAI's
    `parallel_tool_calls: false`) at most one call: "required" is constrained to one, "auto" keeps the first."""

    kind: str
    name: str | None = None
    parallel: bool = True

    def kept_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]

    @property
    def forced(self) -> bool:
        return self.kind != "auto"


def tool_choice_of(tool_choice: Any, tools: list[dict[str, Any]] | None, parallel: bool = True
                   ) -> ToolChoice | None:
    """None when no tools are in play (none given, or tool_choice "none"); ValueError naming the field for a choice
    that names no given tool or has the wrong shape. `parallel`: whether several calls may be made at once."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice {tool_choice!r} needs tools: send the tools it may call")
        return None
    if tool_choice == "none":
        return None
    names = function_tools(tools)
    if tool_choice in (None, "auto"):
        return ToolChoice("auto", parallel=parallel)
    if tool_choice == "required":
        return ToolChoice("required", parallel=parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {tool_choice!r}')
    if name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})")
    return ToolChoice("named", name)


def tool_constraint(choice: ToolChoice, tools: list[dict[str, Any]]) -> StructuredOutputsParams:
    """The output's JSON schema: the named function's parameters, or for "required" a non-empty array of calls.
    Strict, as vLLM's: an object holds only the properties its schema lists unless the schema allows more itself
    (`additionalProperties`), since JSON Schema's open default let a model add keys until max_tokens."""
    schemas = function_tools(tools)
    strict = dict(source="tools[].function.parameters", disable_additional_properties=True)
    if choice.kind == "named":
        return StructuredOutputsParams(json=schemas[choice.name], **strict)
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in schemas.items()]
    one_or_more = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not choice.parallel:
        one_or_more["maxItems"] = 1
    return StructuredOutputsParams(json=one_or_more, **strict)


def parse_forced_calls(choice: ToolChoice, text: str) -> list[ToolCall] | None:
    """The calls in a forced output. Cut short by max_tokens, a call is still returned with its arguments as
    generated (the client sees finish_reason "length", as vLLM answers): a named call's text, and in a
    "required" array the calls it completed, then the one it was writing once its name is out. None when not one
    call is there."""
    if choice.kind == "named":
        return [ToolCall(choice.name, text)]
    items, rest = _whole_items(text)
    calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    cut = _CUT_CALL.match(rest)
    if cut:
        calls.append(ToolCall(json.loads(f'"{cut.group(1)}"'), cut.group(2)))
    return calls or None


# The call a "required" array was writing when max_tokens cut it: its name whole (the grammar writes the schema's
# properties in order, name first), then its arguments so far.
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*(.*)\Z', re.DOTALL)


def _whole_items(text: str) -> tuple[list, str]:
    """The items of a JSON array that are complete in `text`, which may stop anywhere after its "[" (the grammar
    wrote it, so what is there is valid so far), and the text after them."""
    decoder, items = json.JSONDecoder(), []
    i = text.find("[") + 1
    while 0 < i < len(text):
        while i < len(text) and text[i] in " \t\n\r,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        items.append(item)
    return items, text[i:] if i > 0 else ""


