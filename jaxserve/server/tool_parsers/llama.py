"""Llama's tool-call formats. In both the whole reply is the calls; a reply that does not open like one is content.

- `llama3_json` (Llama 3.1, 3.2, 3.3): `{"name": ..., "parameters": {...}}` as the chat template asks, maybe after
  `<|python_tag|>`, several separated by ";". Each call is released as soon as its JSON object closes; what does
  not parse after the calls becomes content, so nothing the model wrote is lost.
- `pythonic` (Llama 3.2 and Llama 4's "pythonic" prompts): a Python list of calls with keyword arguments,
  `[get_weather(city="Paris"), get_time()]`, maybe inside `<|python_start|>...<|python_end|>`. It is read
  whole when the reply ends (with Python's own parser: nothing is evaluated); a reply starting with "[" is held
  back until then, since it may be a list of calls.
"""

from __future__ import annotations

import ast
from typing import Any

from jaxserve.server.tool_parsers.common import (
    RequestIndependent,
    arguments_json,
    call_from_object,
    decode_json_at,
)
from jaxserve.server.tools import ToolCall

SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(RequestIndependent):
    tag = "<|python_tag|>"

    def adjust(self, params):
        return params  # <|python_tag|> is skipped with the other special tokens, or read here when kept

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):]
        elif not body.startswith("{"):
            undecided = not body or self.tag.startswith(body)  # only blanks, or the tag half-way
            return ("", []) if undecided and not final else (text, [])
        calls, pos = [], 0
        while (pos := _skip(body, pos)) < len(body):
            decoded = decode_json_at(body, pos)
            call = call_from_object(decoded[0]) if decoded else None
            if call is None:
                break
            calls.append(call)
            pos = decoded[1]
        if not final:
            return "", calls  # the rest may still become the next call
        if not calls:
            return text, []
        return body[pos:].strip(SEPARATORS), calls


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in SEPARATORS:
        pos += 1
    return pos


class PythonicToolParser(RequestIndependent):
    start, end = "<|python_start|>", "<|python_end|>"

    def adjust(self, params):
        return params

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.start).removesuffix(self.end).strip()
        if not body.startswith("["):
            undecided = not body or self.start.startswith(body)
            return ("", []) if undecided and not final else (text, [])
        if not final:
            return "", []
        calls = parse_call_list(body)
        return ("", calls) if calls else (text, [])


def parse_call_list(source: str) -> list[ToolCall] | None:
    """The calls of `[f(a=1), g()]`, or None when `source` is anything else (positional arguments, attribute
    names such as `brave_search.call`, or values that are not literals)."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
            return None
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal
            return None
        text = arguments_json(arguments)
        if text is None:  # no JSON form: a set, bytes, 1e999
            return None
        calls.append(ToolCall(node.func.id, text))
    return calls


JSON_NAMES = {"true": True, "false": False, "null": None}  # models trained on JSON write these in calls too


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(key): _literal(value) for key, value in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)
