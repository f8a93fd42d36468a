"""Tool calls a model wrote in its own format, parsed out of free text (tool_choice "auto"; vLLM's
--tool-call-parser). One parser so far:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, as the chat templates
  of Qwen2.5, Qwen3, QwQ and the Hermes models ask for.

Text outside the blocks is the message's content. A block whose JSON does not parse, or that names no function,
stays in the content as written, so nothing the model said is lost.
"""

from __future__ import annotations

import json

from jaxserve.server.tools import ToolCall

TOOL_CALL_PARSERS = ("hermes",)


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content, calls) of `text`. Unless `final`, only what further tokens cannot change: text that could be
        the start of a `<tool_call>` and an unterminated block are held back."""
        content, calls, pos = [], [], 0
        while True:
            start = text.find(self.start, pos)
            if start < 0:
                rest = text[pos:]
                content.append(rest if final else rest[: len(rest) - _partial_suffix(rest, self.start)])
                return "".join(content), calls
            content.append(text[pos:start])
            end = text.find(self.end, start)
            if end < 0 and not final:
                return "".join(content), calls
            block_end = len(text) if end < 0 else end + len(self.end)
            call = _parse_call(text[start + len(self.start): end if end >= 0 else len(text)])
            if call is None:
                content.append(text[start:block_end])
            else:
                calls.append(call)
            pos = block_end


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def tool_call_parser(name: str | None) -> HermesToolParser | None:
    if name is None:
        return None
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is not supported; supported: {', '.join(TOOL_CALL_PARSERS)}")
    return HermesToolParser()
