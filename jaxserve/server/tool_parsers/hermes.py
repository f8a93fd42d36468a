"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, as the chat templates
of Qwen2.5, Qwen3, QwQ and the Hermes models ask for.

The text before the first block is the message's content. A block whose JSON does not parse, or that names no
function, is added to the content as written, so a malformed call is not lost. A `</tool_call>` inside an
argument string does not end its block: a block ends where its JSON parses.
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


class HermesToolParser(RequestIndependent):
    start, end = "<tool_call>", "</tool_call>"

    def adjust(self, params):
        """Some models' tokenizers mark `<tool_call>` special: keep special tokens in the text, as vLLM does."""
        return params.replace(skip_special_tokens=False)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content, calls) of `text`: the content is the text before the first call, then any block that is not a
        call, as written; text between and after calls is left out (as vLLM does). Unless `final`, only what more
        tokens cannot change: text that could begin a `<tool_call>` and an unclosed block are held back."""
        first = text.find(self.start)
        if first < 0:
            return (text if final else text[: len(text) - partial_suffix(text, self.start)]), []
        content, calls, pos = [text[:first]], [], first
        while pos >= 0:
            block = self._block(text, pos, final)
            if block is None:  # not settled yet: more tokens may close it
                break
            block_end, call = block
            if call is None:
                content.append(text[pos:block_end])
            else:
                calls.append(call)
            pos = text.find(self.start, block_end)
        return "".join(content), calls

    def _block(self, text: str, pos: int, final: bool) -> tuple[int, ToolCall | None] | None:
        """(where the block opening at `pos` ends, its call or None when malformed), or None while it may still
        change. The block ends at the first `</tool_call>` after which its JSON parses, so the marker inside an
        argument string does not cut the call short; a block that never parses is malformed once `final`."""
        body = pos + len(self.start)
        end = text.find(self.end, body)
        while end >= 0:
            call = _parse_call(text[body:end])
            if call is not None:
                return end + len(self.end), call
            end = text.find(self.end, end + 1)
        if not final:
            return None
        call = _parse_call(text[body:])  # unterminated at the very end
        if call is not None:
            return len(text), call
        first_end = text.find(self.end, body)
        return (len(text) if first_end < 0 else first_end + len(self.end)), None


def _parse_call(body: str) -> ToolCall | None:
    body = body.strip(JSON_BLANKS)
    decoded = decode_json_at(body, 0)
    whole = decoded is not None and decoded[1] == len(body)  # the block is one JSON value and nothing else
    return call_from_object(decoded[0], marked=True) if whole else None
