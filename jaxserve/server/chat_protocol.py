"""Chat completion schemas (pydantic), as the OpenAI chat API and vLLM define them."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from jaxserve.loader.chat_content import check_text_parts
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.server.protocol import OpenAIModel, PromptLogprobs, SamplingFields, UsageInfo
from jaxserve.server.tools import ToolChoice, tool_choice_of, tool_constraint


class ChatMessageParam(BaseModel):
    """One input message. Extra keys (name, tool_calls, ...) are kept and handed to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        check_text_parts(content)
        return content

    def to_template_dict(self) -> dict[str, Any]:
        """The message for the chat template, prepared for it when rendered (loader/chat_content.py)."""
        message = self.model_dump(exclude_none=True)
        message["content"] = self.content  # None too: the format decides ("" or no parts)
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is left open to go on with
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking...)
    documents: list[dict[str, str]] | None = None  # vLLM's: retrieved passages, for templates that cite them
    chat_template: str | None = None  # vLLM's, refused: below
    add_special_tokens: bool = False  # vLLM's; true (the tokenizer's BOS over the template's own) is refused
    echo: bool = False  # vLLM's: the reply begins with the last message when it is in the reply's role
    reasoning_effort: str | None = None  # OpenAI's; reaches the chat template as `reasoning_effort`, as in vLLM
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the message (--reasoning-parser)
    tool_choice: Any = None
    tools: list[dict[str, Any]] | None = None  # tool calls: server/tools.py
    parallel_tool_calls: bool | None = None  # OpenAI's default (None) is true; false: at most one call
    function_call: Any = None  # OpenAI's deprecated names for tool_choice and tools
    functions: list[dict[str, Any]] | None = None

    @field_validator("functions")
    @classmethod
    def _no_legacy_function_calls(cls, functions: list[dict[str, Any]] | None, info: ValidationInfo):
        # Refused rather than ignored: the client would wait for a function call that never comes. A choice of
        # "none" asks for none, so the functions are then simply not used (as vLLM does).
        if functions and info.data.get("function_call") != "none":
            raise ValueError('functions are not supported (OpenAI deprecated them for tools): send tools and '
                             'tool_choice instead, or set function_call to "none"')
        return functions

    @field_validator("add_special_tokens")
    @classmethod
    def _template_tokens_only(cls, add: bool):
        if add:
            raise ValueError("add_special_tokens true is not supported in chat: the chat template writes the "
                             "prompt's special tokens (true would add the tokenizer's BOS again); leave it out")
        return add

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, template: str | None):
        # Refused rather than ignored: the prompt would silently differ from the one the client wrote for. A
        # client's Jinja template runs on the server, which vLLM too refuses unless started trusting them.
        if template is not None:
            raise ValueError("chat_template in a request is not supported: the server renders every conversation "
                             "with its own template (jaxserve serve --chat-template FILE picks it); leave it out")
        return template

    def echoed(self) -> str:
        """vLLM's `echo`: the text the reply repeats first, the last message's, when that message is in the
        reply's role (the assistant's; with add_generation_prompt false, whatever role the last message has),
        as when `continue_final_message` goes on from it. Text parts are joined by newlines, as vLLM does."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        content = last.content
        return "\n".join(part["text"] for part in content) if isinstance(content, list) else content or ""

    def resolved_tool_choice(self) -> ToolChoice | None:
        """None (no tools in play), or what the tools ask of the output (server/tools.py)."""
        return tool_choice_of(self.tool_choice, self.tools, parallel=self.parallel_tool_calls is not False)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        choice, asked = self.resolved_tool_choice(), super()._structured_outputs()
        if choice is None or not choice.forced:
            return asked
        if asked is not None:
            raise ValueError("tool_choice cannot be combined with response_format or structured outputs: a forced "
                             "tool call already fixes the output's format")
        try:
            return tool_constraint(choice, self.tools)
        except ValueError as e:  # a parameters schema no grammar can be made of
            raise ValueError(f"tools[].function.parameters is invalid: {e}") from None

    def to_sampling_params(self, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.echo and self.resolved_tool_choice() is not None:
            raise ValueError("echo cannot be combined with tools: a tool call is no message to go on from; remove "
                             "one of them")
        # As vLLM: top_logprobs 0 asks for nothing, so it needs no logprobs; the most is the server's --max-logprobs.
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
            if self.top_logprobs > 0 and not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:  # named as the body named it
            raise ValueError(f"max_completion_tokens must be >= 1 or None, got {self.max_completion_tokens}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(model_defaults, max_tokens=max_tokens,
                                     logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                     prompt_logprobs=self.prompt_logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template_dict() for message in self.messages]

    def rendering(self, default_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """encode_chat's options beyond the messages; the request's template variables win over the server's
        `--default-chat-template-kwargs`."""
        return {"continue_final_message": self.continue_final_message,
                "chat_template_kwargs": template_kwargs(default_kwargs, self._own_template_kwargs()),
                "tools": self.tools or None,  # also under tool_choice "none", as in vLLM
                "documents": self.documents}

    def _own_template_kwargs(self) -> dict[str, Any] | None:
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        # As vLLM: an effort turns thinking on for templates that want it asked for (Gemma 4), "none" off (Qwen3's
        # enable_thinking), unless the request's own variables say otherwise
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none",
                **(self.chat_template_kwargs or {})}



def template_kwargs(server_defaults: dict[str, Any] | None, own: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's chat template variables over the server's defaults (None when neither sets any)."""
    return {**(server_defaults or {}), **(own or {})} or None


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatLogProbsContent] | None = None


class ChatMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # vLLM's (formerly reasoning_content): with --reasoning-parser
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asks for them
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: this chunk's new tokens


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: in the first chunk
