"""A streamed /v1/responses answer: the chat stream's deltas (reasoning, text, tool calls) as the Responses
API's events, building the output items as they go.

Each output item opens (`response.output_item.added`, for text also `response.content_part.added`), takes its
deltas, and closes (`...done` events, then `response.output_item.done`) when the next kind of output starts or
the answer ends; the items are in output order, reasoning first, as the model wrote them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.server.chat_protocol import DeltaMessage
from jaxserve.server.responses_protocol import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    text_part,
)


@dataclass
class _OpenItem:
    index: int  # output_index
    item: dict[str, Any]  # as announced, in progress
    text: str = ""  # reasoning, message text or call arguments so far
    call_index: int | None = None  # a function call's index among the chat deltas' tool calls

    @property
    def kind(self) -> str:
        return self.item["type"]

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": self.index}


class ResponseEvents:
    def __init__(self, calls_whole: bool):
        self.calls_whole = calls_whole  # calls come whole (tool_choice "auto"): never closed as incomplete
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self._open: _OpenItem | None = None
        # Calls announced (id, name) whose item opens with their first arguments: a forced call is announced in
        # the first chunk, before any reasoning, and must not be closed by it.
        self._announced: dict[int, dict[str, Any]] = {}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return body

    def delta(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            index = call.get("index", 0)
            if "id" in call:  # a new call (a forced call's later deltas carry only more arguments)
                self._announced[index] = call
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                events += self._arguments(index, arguments)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close what is open (and calls announced with no arguments yet); an answer with no output at all still
        gets its (empty) message, as when whole."""
        events = self.close(status)
        for index in list(self._announced):
            events += self._open_call(index) + self.close(status)
        if not self.items:
            events += self._open_text("message") + self.close(status)
        return events

    def _arguments(self, index: int, arguments: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open.call_index != index:
            events += self.close() + self._open_call(index)
        self._open.text += arguments
        return [*events, self.event("response.function_call_arguments.delta", **self._open.where(), delta=arguments)]

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Finish the open item, if any (`status`: of a message that max_output_tokens cut short)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = item.where()
        if item.kind == "reasoning":
            done = reasoning_item(item.item["id"], item.text, status)
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part={"type": "reasoning_text", "text": item.text})]
        elif item.kind == "message":
            done = message_item(item.item["id"], item.text, status)
            events = [self.event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=text_part(item.text))]
        else:  # a forced call max_output_tokens cut short is incomplete, as when whole
            done = function_call_item(item.item["id"], item.item["call_id"], item.item["name"], item.text,
                                      "completed" if self.calls_whole else status)
            events = [self.event("response.function_call_arguments.done", **where, name=item.item["name"],
                                 arguments=item.text)]
        self.items.append(done)
        return [*events, self.event("response.output_item.done", output_index=item.index, item=done)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = [] if self._open is not None and self._open.kind == kind else self.close() + self._open_text(kind)
        self._open.text += text
        if kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", **self._open.where(), content_index=0,
                                        delta=text)]
        return [*events, self.event("response.output_text.delta", **self._open.where(), content_index=0, delta=text,
                                    logprobs=[])]

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item, part = reasoning_item(new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(new_id("msg"), "", "in_progress"), text_part("")
        self._open = _OpenItem(len(self.items), item)
        return [self.event("response.output_item.added", output_index=self._open.index, item=item),
                self.event("response.content_part.added", **self._open.where(), content_index=0, part=part)]

    def _open_call(self, index: int) -> list[dict[str, Any]]:
        call = self._announced.pop(index)
        item = function_call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
        self._open = _OpenItem(len(self.items), item, call_index=index)
        return [self.event("response.output_item.added", output_index=self._open.index, item=item)]
