"""`mistral`: calls after the `[TOOL_CALLS]` token, in either of Mistral's forms:

- a JSON list, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers v3 to v7: Mistral 7B v0.3,
  Mixtral 8x22B, Nemo, Small 3.1);
- one `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizers v11 on: Small 3.2, Magistral, Devstral).

The text before the first `[TOOL_CALLS]` is the content; a call that does not parse is added to it as written,
and text after a call's JSON is left out, as hermes does (and vLLM). Each call is released once its JSON
closes. Call ids are nine letters and digits: Mistral's chat templates refuse
any other id when the conversation comes back with the tool's answer.
"""

from __future__ import annotations

import secrets
import string

from jaxserve.server.tool_parsers.common import (
    RequestIndependent,
    call_from_object,
    decode_json_at,
    partial_suffix,
)
from jaxserve.server.tools import ToolCall

ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))


class MistralToolParser(RequestIndependent):
    tag, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def adjust(self, params):
        """[TOOL_CALLS] and [ARGS] are special tokens: keep them in the text, as vLLM does."""
        return params.replace(skip_special_tokens=False)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """Content and calls; a call is read where its [TOOL_CALLS] is, its JSON to its own end, so the marker
        inside an argument string is no new call. One that does not parse waits for more tokens; once final, it
        and everything after it are content, as written."""
        first = text.find(self.tag)
        if first < 0:
            return (text if final else text[: len(text) - partial_suffix(text, self.tag)]), []
        content, calls, pos = [text[:first]], [], first
        while pos >= 0:
            found = self._calls_at(text, pos + len(self.tag))
            if found is None and not final:
                break
            if found is None:  # final: the rest as written (a marker in it may sit inside an unclosed string)
                content.append(text[pos:])
                break
            calls.extend(found[0])
            pos = text.find(self.tag, found[1])
        return "".join(content), calls

    def _calls_at(self, text: str, start: int) -> tuple[list[ToolCall], int] | None:
        """(the calls written from `start`, just after a [TOOL_CALLS], and where they end), or None when they do
        not parse (yet)."""
        body = start + len(text[start:]) - len(text[start:].lstrip())
        if text.startswith("[", body):  # [{"name": ..., "arguments": {...}}, ...]
            decoded = decode_json_at(text, body)
            if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
                return None
            calls = [call_from_object(item, mistral_call_id(), marked=True) for item in decoded[0]]
            return None if None in calls else (calls, decoded[1])
        args = text.find(self.args_tag, body)  # name[ARGS]{...}
        name = text[body:args].strip() if args >= 0 else ""
        if not name or self.tag in name:
            return None
        after = args + len(self.args_tag)
        decoded = decode_json_at(text, after + len(text[after:]) - len(text[after:].lstrip()))
        if decoded is None or not isinstance(decoded[0], dict):
            return None
        call = call_from_object({"name": name, "arguments": decoded[0]}, mistral_call_id())
        return None if call is None else ([call], decoded[1])
