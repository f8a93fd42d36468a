"""The latest /v1/responses answers made with `store` (OpenAI's default), in memory: enough for
`previous_response_id` conversations and GET /v1/responses/{id}, and bounded (the oldest go first) so a busy server
cannot grow without end; vLLM keeps them without a bound, behind an environment flag. A restart forgets them.
Used on the event loop only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to and including its answer, for previous_response_id


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._entries[body["id"]] = StoredResponse(body, conversation)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
