"""The OpenAI Responses API (POST /v1/responses), as vLLM serves it: a request is read into the chat request this
server already runs (same template, tools, reasoning and structured outputs), and the chat answer is written back
as the Responses API's output items (reasoning, message, function calls).

Only what a local model can do is accepted: text input, function tools, `text.format` for JSON. Hosted tools
(web search, file search, code interpreter, MCP), images, files and background runs are refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.outputs import RequestOutput
from jaxserve.server.chat_protocol import ChatCompletionRequest, ChatMessage
from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import RequestModel, SamplingFields
from jaxserve.server.request_bodies import parse_request

TEXT_PART_TYPES = ("input_text", "output_text", "text")
# vLLM's sampling extras a Responses body may carry, handed to the chat request as they are; the fields the
# Responses API names itself (and those it has no use for) are not.
FORWARDED_FIELDS = (set(SamplingFields.model_fields) - {"model", "n", "stream", "stream_options", "temperature",
                                                        "top_p", "user", "response_format", "prompt_logprobs",
                                                        "return_token_ids"}) | {"chat_template_kwargs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# Fields of other APIs a client might send here by mistake: refused with the Responses API's own name for them,
# rather than dropped (an unconstrained or unbounded answer would be the silent result).
MISPLACED_FIELDS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
                    "max_completion_tokens": "max_output_tokens"}
# Asked of OpenAI's service, not served here: refused by name.
UNSUPPORTED_FIELDS = {
    "background": "background responses are not supported: leave background unset and stream instead",
    "conversation": "conversations (the Conversations API) are not supported: continue with previous_response_id",
    "top_logprobs": "logprobs are not supported on /v1/responses yet: use /v1/chat/completions with logprobs",
}


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="allow")  # vLLM's sampling extras (top_k, seed, ...): FORWARDED_FIELDS
    EXTRA_FIELDS_USED = frozenset(FORWARDED_FIELDS | set(MISPLACED_FIELDS) | set(UNSUPPORTED_FIELDS))

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # None (an explicit null, which OpenAI accepts) means the default, as below
    store: bool | None = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True  # false: at most one call (as chat's field of that name)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort"}: the chat template's reasoning_effort, as vLLM does
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"

    @property
    def stored(self) -> bool:
        return self.store is not False

    def chat_request(self, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request that answers this one, and the conversation so far as chat messages (the earlier
        turns, then this input). `instructions` lead as the system message, this time only: OpenAI never carries
        them over to a later response."""
        self._refuse_what_is_not_served()
        conversation = history + input_messages(self.input)
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        extras = {key: value for key, value in (self.model_extra or {}).items() if key in FORWARDED_FIELDS}
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            extras["chat_template_kwargs"] = {"reasoning_effort": effort, **(extras.get("chat_template_kwargs") or {})}
        chat = parse_request(ChatCompletionRequest, {
            **extras, "model": self.model, "messages": system + conversation,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
            "response_format": response_format(self.text), "stream": bool(self.stream),
            "parallel_tool_calls": self.parallel_tool_calls,
        })
        chat._response_format_name = "text.format"  # what the client sent, for errors about it
        return chat, conversation

    def _refuse_what_is_not_served(self) -> None:
        given = {**(self.model_extra or {})}
        for name, message in UNSUPPORTED_FIELDS.items():
            if given.get(name):
                raise bad_request(message, param=name)
        for name, own in MISPLACED_FIELDS.items():
            if given.get(name) is not None:
                raise bad_request(f"{name} belongs to the chat completions API: on /v1/responses send {own}",
                                  param=name)
        if any("logprobs" in entry for entry in self.include or []):
            raise bad_request(UNSUPPORTED_FIELDS["top_logprobs"], param="include")

    def echo_fields(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id, "reasoning": self.reasoning,
                "store": self.stored, "temperature": self.temperature, "top_p": self.top_p,
                "text": self.text or {"format": {"type": "text"}}, "tool_choice": self.tool_choice or "auto",
                "tools": self.tools or [], "truncation": self.truncation or "disabled", "user": self.user}


# --- input --------------------------------------------------------------------------------------------------
def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a function call joins the assistant message before it (one turn's
    text and calls are one message to chat templates), its output is a "tool" message, and a reasoning item goes
    with the assistant message after it as `reasoning_content` (templates such as Qwen3's write it back into
    the current turn, so the prompt is what the model produced and its cached blocks match)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise bad_request("input must not be empty: give a string or a list of input items", param="input")
    messages: list[dict[str, Any]] = []
    reasoning = None  # of the assistant turn that comes next
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))
            continue
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, i)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": text})
        else:
            raise bad_request(f"input[{i}] has type {kind!r}, which is not supported: send messages, function_call "
                              "and function_call_output items", param="input")
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"input[{i}].role must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                          param="input")
    content = item.get("content")
    return {"role": "system" if role == "developer" else role,
            "content": content if isinstance(content, str) else _text(content, i)}


def _text(parts: Any, i: int) -> str:
    if not isinstance(parts, list):
        raise bad_request(f"input[{i}] content must be a string or a list of text parts", param="input")
    for part in parts:
        is_text = isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str)
        if not is_text:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"input[{i}] has a content part of type {kind!r}: only text parts (input_text, "
                              "output_text) are supported", param="input")
    return "".join(part["text"] for part in parts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}] ({item.get('type')}) needs {key} as a string, got {value!r}", param="input")
    return value


# --- tools and formats --------------------------------------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters"}) in chat's shape."""
    if not tools:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}] has type {tool.get('type')!r}: only function tools are supported (hosted "
                              "tools such as web_search or file_search are OpenAI's own)", param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string, got {tool.get('name')!r}", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice {choice!r} is not supported: use 'auto', 'none', 'required' or "
                              '{"type": "function", "name": ...}', param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format of type 'json_schema' needs its JSON schema as 'schema' (and a 'name')",
                              param="text")
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(f"text.format must be of type 'text', 'json_object' or 'json_schema', got {fmt!r}", param="text")


# --- output -------------------------------------------------------------------------------------------------
def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = [text_part(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": part}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: ChatMessage, finish_reason: str | None, calls_whole: bool) -> list[dict[str, Any]]:
    """A finished chat message as output items: its reasoning, its text, its tool calls (an answer with none of
    them is one empty message, as when streamed). Cut short by max_output_tokens, the last item is incomplete, as
    streamed: the reasoning or the text as far as it got, or a forced call's arguments. A call a parser read out of
    the text (`calls_whole`, tool_choice "auto") is whole even then."""
    items = [reasoning_item(new_id("rs"), message.reasoning)] if message.reasoning else []
    if message.content or not (items or message.tool_calls):
        items.append(message_item(new_id("msg"), message.content or ""))
    for call in message.tool_calls:
        function = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    if finish_reason == "length" and not (calls_whole and items[-1]["type"] == "function_call"):
        items[-1]["status"] = "incomplete"
    return items


def response_body(response_id: str, model: str, request: ResponsesRequest, output: list[dict[str, Any]], *,
                  status: str = "completed", usage: dict[str, Any] | None = None, created_at: float | None = None
                  ) -> dict[str, Any]:
    """The response object (`status` "in_progress" while streaming, "incomplete" when max_output_tokens cut it)."""
    return {"id": response_id, "object": "response", "created_at": int(created_at or time.time()), "model": model,
            "status": status, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **request.echo_fields()}


def usage(final: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    generated = sum(len(completion.token_ids) for completion in final.outputs)
    prompt = len(final.prompt_token_ids)
    # cache_write_tokens is OpenAI's paid cache writes, which a local prefix cache has none of.
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens,
                                                             "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + generated}


# --- the answer's schema (GET /openapi.json): what response_body and the items above write, field for field ----
class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")  # tests/server/test_responses.py holds real answers to these


class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class ReasoningText(_Answer):
    type: Literal["reasoning_text"]
    text: str


class MessageItem(_Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningItem(_Answer):
    id: str
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ReasoningText]


class FunctionCallItem(_Answer):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as generated
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(_Answer):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(_Answer):
    reasoning_tokens: int


class ResponseUsage(_Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Answer):
    """A response object: POST /v1/responses (whole, and in the stream's events), GET /v1/responses/{id}."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[Annotated[MessageItem | ReasoningItem | FunctionCallItem, Field(discriminator="type")]]
    usage: ResponseUsage | None  # None while streaming
    error: None
    incomplete_details: IncompleteDetails | None
    # the request's settings, repeated (ResponsesRequest.echo_fields)
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: str
    user: str | None


class DeletedResponse(_Answer):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
