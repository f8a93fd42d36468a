"""The latest /v1/responses answers made with `store` (OpenAI's default), in memory: enough for
`previous_response_id` conversations and GET /v1/responses/{id}, and bounded in number and in text (the oldest go
first) so a busy server cannot grow without end; vLLM keeps them without a bound, behind an environment flag. A
restart forgets them. Used on the event loop only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024
# Characters of conversation text kept in all (a message in several stored conversations counts in each, so the
# bound errs on the small side).
DEFAULT_MAX_CHARS = 256 * 2**20


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to and including its answer, for previous_response_id
    chars: int  # its conversation's text, counted against the store's budget


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_chars: int = DEFAULT_MAX_CHARS):
        self.capacity = capacity
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = sum(len(str(message.get(key) or "")) for message in conversation
                    for key in ("content", "tool_calls", "reasoning_content"))
        self._entries[body["id"]] = StoredResponse(body, conversation, chars)
        self._chars += chars
        while len(self._entries) > self.capacity or (self._chars > self.max_chars and len(self._entries) > 1):
            self._chars -= self._entries.popitem(last=False)[1].chars

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        self._chars -= entry.chars if entry is not None else 0
        return entry is not None
