"""`mistral`: calls after the `[TOOL_CALLS]` token, in either of Mistral's forms:

- a JSON list, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers v3 to v7: Mistral 7B v0.3,
  Mixtral 8x22B, Nemo, Small 3.1);
- one `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizers v11 on: Small 3.2, Magistral, Devstral).

The text before the first `[TOOL_CALLS]` is the content; a call that does not parse is added to it as written.
Each call is released once its JSON closes. Call ids are nine letters and digits: Mistral's chat templates refuse
any other id when the conversation comes back with the tool's answer.
"""

from __future__ import annotations

import secrets
import string

from jaxserve.server.tool_parsers.common import call_from_object, decode_json_at, partial_suffix
from jaxserve.server.tools import ToolCall

ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))


class MistralToolParser:
    tag, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def adjust(self, params):
        """[TOOL_CALLS] and [ARGS] are special tokens: keep them in the text, as vLLM does."""
        return params.replace(skip_special_tokens=False)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        first = text.find(self.tag)
        if first < 0:
            return (text if final else text[: len(text) - partial_suffix(text, self.tag)]), []
        content, calls = [text[:first]], []
        segments = text[first + len(self.tag):].split(self.tag)
        for i, segment in enumerate(segments):
            settled = final or i < len(segments) - 1  # a later [TOOL_CALLS] ends this one
            found = self._segment_calls(segment)
            if found is None and not settled:
                break
            calls.extend(found or [])
            if found is None:
                content.append(self.tag + segment)
        return "".join(content), calls

    def _segment_calls(self, segment: str) -> list[ToolCall] | None:
        """The calls of what follows one [TOOL_CALLS], or None when they do not parse (yet)."""
        body = segment.strip()
        if body.startswith("["):
            decoded = decode_json_at(body, 0)
            if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
                return None
            calls = [call_from_object(item, mistral_call_id()) for item in decoded[0]]
            return None if None in calls else calls
        name, marker, arguments = body.partition(self.args_tag)
        decoded = decode_json_at(arguments.strip(), 0) if marker and name.strip() else None
        if decoded is None or not isinstance(decoded[0], dict):
            return None
        return [call_from_object({"name": name.strip(), "arguments": decoded[0]}, mistral_call_id())]
