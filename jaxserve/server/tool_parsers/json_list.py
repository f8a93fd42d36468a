"""Calls written as one JSON list after a marker, `[{"name": ..., "arguments": {...}}, ...]`:

- `granite` (Granite 3.x): the list after `<|tool_call|>` (Granite 3.0) or `<tool_call>` (3.1 on), any text before
  the marker being the content, or the reply is the list (the special `<|tool_call|>` skipped);
- `phi4_mini_json` (Phi-4-mini): `functools[...]`, maybe after some text, which is the message's content;
- `xlam` (Salesforce xLAM): the list alone, or after some text (the content) in a ```json fence, after
  `[TOOL_CALLS]` or in `<tool_call>` tags, whose closing fence or tag is dropped with the calls.

The calls are released when the list closes; text after it is content once the reply ends. A list that does not
parse, or holds anything but calls, is content as written, so nothing the model wrote is lost.
"""

from __future__ import annotations

from jaxserve.server.tool_parsers.common import (
    JSON_BLANKS,
    RequestIndependent,
    call_from_object,
    decode_json_at,
    partial_suffix,
)
from jaxserve.server.tools import ToolCall


class GraniteToolParser(RequestIndependent):
    markers = ("<|tool_call|>", "<tool_call>")

    def adjust(self, params):
        return params  # <|tool_call|> is skipped with the other special tokens: the list alone is read then

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        found = [(text.find(m), m) for m in self.markers if m in text]
        if found:  # the list follows the first marker; prose before it is content (vLLM 0.34's rule)
            first, marker = min(found)
            content = text[:first] if text[:first].strip() else ""
            body = text[first + len(marker):].lstrip()
            if not body.startswith("["):  # a marker still waiting for its list, or none comes
                return (content, []) if not body and not final else (text, [])
            return _calls_from(text, len(text) - len(body), content, final)
        body = text.lstrip()
        if body.startswith("["):  # the reply is the list (the <|tool_call|> token was skipped)
            return _calls_from(text, len(text) - len(body), "", final)
        if final:
            return text, []
        released = text[: len(text) - max(partial_suffix(text, m) for m in self.markers)]
        return (released if released.strip() else ""), []  # blanks first: a list or a marker may come next


class Phi4MiniJsonToolParser(RequestIndependent):
    opening = "functools["

    def adjust(self, params):
        return params

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        first = text.find(self.opening)
        if first < 0:
            return (text if final else text[: len(text) - partial_suffix(text, self.opening)]), []
        return _calls_from(text, first + len(self.opening) - 1, text[:first], final)


class XLAMToolParser(RequestIndependent):
    # Where a list of calls may open, each with what closes it (a fence opened as ```json closes as ```).
    openings = {"```json": "```", "```": "```", "[TOOL_CALLS]": "", "<tool_call>": "</tool_call>"}

    def adjust(self, params):
        return params

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        body = text.lstrip()
        if not body and not final:  # blanks only: the list may come next, and they would be taken back
            return "", []
        if body.startswith("["):  # the reply is the list
            return _calls_from(text, len(text) - len(body), "", final)
        found = [(text.find(o), -len(o), o) for o in self.openings if o in text]
        if not found:
            held = max(partial_suffix(text, o) for o in self.openings)
            return (text if final else text[: len(text) - held]), []
        first, _, opening = min(found)  # the earliest; at one place the longest (```json before ```)
        after = text[first + len(opening):].lstrip()
        if not after.startswith("["):  # a fence of code, or an opening still waiting for its list
            waiting = not after or (opening == "```" and "```json".startswith("```" + after))
            return (text[:first], []) if waiting and not final else (text, [])
        return _calls_from(text, len(text) - len(after), text[:first], final, closing=self.openings[opening])


def _calls_from(text: str, list_start: int, content: str, final: bool,
                closing: str = "") -> tuple[str, list[ToolCall]]:
    """(content, calls) for a reply whose list of calls opens at `list_start` after `content`. While the list is
    open nothing after `content` is released; once it closed, its calls are, and the text after it when `final`
    (less `closing`, the fence or tag that wrapped the list)."""
    after = text[list_start + 1:].lstrip(JSON_BLANKS)
    if after and after[0] not in "{]":  # "[1]", "[Python](...)": a list of no calls, text to release at once
        return text, []
    decoded = decode_json_at(text, list_start)
    if decoded is None:
        return (text, []) if final else (content, [])
    items, end = decoded
    calls = [call_from_object(item) for item in items] if isinstance(items, list) and items else [None]
    if None in calls:
        return text, []
    rest = text[end:].strip(JSON_BLANKS)
    if closing and rest.startswith(closing):
        rest = rest[len(closing):].strip(JSON_BLANKS)
    return (content + rest if final else content), calls
