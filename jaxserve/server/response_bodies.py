"""Finished RequestOutputs -> response body, per endpoint: shared by the HTTP server and `jaxserve batch`.

`CompletionRendering` and `ChatRendering` hold what a body is built from (the parsed request, the model name to
answer with, the response id, the tokenizer for token texts, the server's `OutputOptions`); the server's streaming
jobs extend them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.server.chat_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessage,
)
from jaxserve.server.logprobs import TokenName, chat_logprobs, completion_logprobs, prompt_logprobs_by_id, token_namer
from jaxserve.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
)
from jaxserve.server.reasoning_parsers import PromptReasoning, ReasoningParser
from jaxserve.server.tool_parsers import ToolParser
from jaxserve.server.tools import ToolChoice, parse_forced_calls


@dataclass(frozen=True)
class OutputOptions:
    """What completion and chat bodies carry beyond OpenAI's defaults, server-wide (vLLM's serve flags)."""

    tokens_as_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage counts the prompt tokens cached
    response_role: str = "assistant"  # --response-role: the role a chat reply names after a generation prompt
    force_include_usage: bool = False  # --enable-force-include-usage: every stream reports its usage, per chunk too

    def role(self, request) -> str:
        """A chat reply's role, as vLLM names it: the response role after a generation prompt, else (the model
        continuing the conversation's last message) that message's role."""
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    def usage_chunk(self, request) -> bool:
        """Whether a stream ends with a usage chunk: asked for by stream_options, or forced for every stream."""
        return request.stream and (self.force_include_usage or request.include_usage_chunk)

    def usage_in_every_chunk(self, request) -> bool:
        return request.stream and (self.force_include_usage or request.usage_in_every_chunk)

    def usage(self, finals: list[RequestOutput]) -> UsageInfo:
        cached = sum(output.num_cached_tokens for output in finals) if self.prompt_tokens_details else None
        return UsageInfo.of(prompt_token_count(finals), completion_token_count(finals), cached)

    def for_request(self, request) -> OutputOptions:
        """These options under a request's own `return_tokens_as_token_ids`, which wins where it is given (true
        or false), as in vLLM."""
        own = request.return_tokens_as_token_ids
        return self if own is None else dataclasses.replace(self, tokens_as_ids=own)

    def token_name(self, tokenizer) -> TokenName:
        return token_namer(lambda token_id: tokenizer.decode([token_id]), self.tokens_as_ids)

    def prompt_logprobs(self, output: RequestOutput, request, tokenizer) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs field, for a request that asks for them (None otherwise)."""
        if request.prompt_logprobs is None:
            return None
        return prompt_logprobs_by_id(output, request.prompt_logprobs, self.token_name(tokenizer))


def completion_token_count(outputs: list[RequestOutput]) -> int:
    return sum(len(completion.token_ids) for output in outputs for completion in output.outputs)


def prompt_token_count(outputs: list[RequestOutput]) -> int:
    return sum(len(output.prompt_token_ids) for output in outputs)


@dataclass
class CompletionRendering:
    """How one /v1/completions request's outputs turn into choices (whole, or as stream deltas)."""

    request: CompletionRequest
    model: str
    request_id: str
    tokenizer: Any
    options: OutputOptions = field(default_factory=OutputOptions)

    created: int = field(default_factory=lambda: int(time.time()), init=False)  # one time for every chunk

    def __post_init__(self) -> None:
        self.options = self.options.for_request(self.request)

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.request.n + completion.index

    def shown(self, output: RequestOutput) -> RequestOutput:
        """The output as the response shows it: under echo with max_tokens 0, without the one token generated."""
        if not self.request.echo_only:
            return output
        hidden = [dataclasses.replace(completion, text="", token_ids=[], logprobs=[], cumulative_logprob=None)
                  for completion in output.outputs]
        return dataclasses.replace(output, outputs=hidden)

    def prompt_text(self, output: RequestOutput) -> str:
        return output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)

    def prompt_logprobs(self, output: RequestOutput) -> CompletionLogProbs:
        positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return completion_logprobs(output.prompt_token_ids, positions, self.request.logprobs,
                                   self.options.token_name(self.tokenizer))

    def generated_logprobs(self, completion: CompletionOutput, first_token: int, text_offset: int
                           ) -> CompletionLogProbs:
        return completion_logprobs(completion.token_ids[first_token:], (completion.logprobs or [])[first_token:],
                                   self.request.logprobs, self.options.token_name(self.tokenizer), text_offset)

    def full_response(self, finals: list[RequestOutput]) -> CompletionResponse:
        """The whole (non-streamed) response, from each prompt's final output in prompt order."""
        finals = [self.shown(output) for output in finals]
        choices = [self._full_choice(prompt_index, output, completion)
                   for prompt_index, output in enumerate(finals) for completion in output.outputs]
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                  usage=self.options.usage(finals), created=self.created)

    def _full_choice(self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
                     ) -> CompletionChoice:
        prefix = self.prompt_text(output) if self.request.echo else ""
        logprobs = None
        if self.request.logprobs is not None:
            echoed = self.prompt_logprobs(output) if self.request.echo else None
            logprobs = self.generated_logprobs(completion, 0, end_offset(echoed))
            if echoed is not None:
                logprobs = concat_logprobs(echoed, logprobs)
        ids = bool(self.request.return_token_ids)
        return CompletionChoice(index=self.choice_index(prompt_index, completion), text=prefix + completion.text,
                                logprobs=logprobs, finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                                prompt_logprobs=self.options.prompt_logprobs(output, self.request, self.tokenizer),
                                prompt_token_ids=output.prompt_token_ids if ids else None,
                                token_ids=list(completion.token_ids) if ids else None)


def end_offset(logprobs: CompletionLogProbs | None) -> int:
    """Where the next token's text_offset starts: after the last token's name, as vLLM counts offsets over the
    echoed prompt and the output in one pass (with "token_id:N" names too, so they never go back)."""
    if logprobs is None or not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def concat_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


@dataclass(frozen=True)
class OutputParsers:
    """How chat output is read beyond its text: tool calls (tool_choice "auto") and reasoning, as configured."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def bind_reasoning(self, prompt_token_ids: list[int], params) -> PromptReasoning | None:
        return self.reasoning and self.reasoning.bind(prompt_token_ids, params)


@dataclass
class ChatRendering:
    """How one /v1/chat/completions request's output turns into choices (whole, or as stream deltas)."""

    request: ChatCompletionRequest
    model: str
    request_id: str
    tokenizer: Any
    tool_parser: ToolParser | None = None  # reads tool calls out of the text under tool_choice "auto"
    reasoning: PromptReasoning | None = None  # splits the reasoning off the answer (--reasoning-parser)
    options: OutputOptions = field(default_factory=OutputOptions)
    tool_choice: ToolChoice | None = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()), init=False)  # one time for every chunk

    def __post_init__(self) -> None:
        self.options = self.options.for_request(self.request)
        self.tool_choice = self.request.resolved_tool_choice()
        if self.tool_parser is not None:  # a parser may read a call by the request's tool schemas
            self.tool_parser = self.tool_parser.for_tools(self.request.tools)

    @property
    def calls_whole(self) -> bool:
        """Whether the tool calls are released whole: read out of the text by a parser (tool_choice "auto"); a
        forced call's arguments stream as they are written, and max_tokens may cut them."""
        return self.tool_choice is not None and self.tool_choice.kind == "auto"

    @property
    def sends_logprobs(self) -> bool:
        return bool(self.request.logprobs) and not self.hides_tokens

    @property
    def hides_tokens(self) -> bool:
        """With the reasoning left out (include_reasoning false), the logprobs' token names and the token ids
        would spell it out: neither is sent (as vLLM)."""
        return self.reasoning is not None and not self.request.include_reasoning

    def logprobs(self, completion: CompletionOutput, first_token: int = 0) -> ChatLogProbs | None:
        if not self.sends_logprobs:
            return None
        return chat_logprobs(completion.token_ids[first_token:], (completion.logprobs or [])[first_token:],
                             self.request.top_logprobs or 0, self.options.token_name(self.tokenizer))

    def answer(self, completion: CompletionOutput, final: bool) -> tuple[str | None, str]:
        """(reasoning, the answer's text) of the output so far (`split` of the reasoning parser, if any)."""
        if self.reasoning is None:
            return None, completion.text
        reasoning, text = self.reasoning.split(completion.text, final)
        return (reasoning if self.request.include_reasoning else None), text

    def message(self, completion: CompletionOutput) -> tuple[ChatMessage, str | None]:
        """A finished choice's message and finish reason: its text, or the tool calls in it, after any reasoning.
        As vLLM and OpenAI, finish_reason is "tool_calls" when the model chose to call, "stop" when tool_choice
        named the function."""
        choice, reason = self.tool_choice, completion.finish_reason
        reasoning, text = self.answer(completion, final=True)
        # With reasoning split off, an answer not yet begun is None, as in vLLM.
        role = self.options.role(self.request)
        plain = ChatMessage(role=role, content=None if reasoning is not None and not text else text,
                            reasoning=reasoning)
        if choice is None:
            return plain, reason
        if choice.kind == "auto":
            content, calls = self.tool_parser.split(text, final=True)
            content, calls = content or None, choice.kept_calls(calls)
        else:  # forced: the whole text is the call(s), as far as max_tokens let it go
            content, calls = None, parse_forced_calls(choice, text)
        if not calls:
            return plain, reason
        # Only a model that stopped by itself finished its calls: a length cut stays "length" (vLLM 0.34's), so a
        # client can tell a reply cut short (a call perhaps half written, left in the content) from a whole one.
        if choice.kind in ("auto", "required") and reason == "stop":
            reason = "tool_calls"
        return ChatMessage(role=role, content=content, reasoning=reasoning,
                           tool_calls=[call.body() for call in calls]), reason

    def full_response(self, output: RequestOutput) -> ChatCompletionResponse:
        """The whole (non-streamed) response from the request's final output."""
        choices = [self._full_choice(completion) for completion in sorted(output.outputs, key=lambda c: c.index)]
        prompt_logprobs = self.options.prompt_logprobs(output, self.request, self.tokenizer)
        prompt_ids = output.prompt_token_ids if self.request.return_token_ids else None
        return ChatCompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                      usage=self.options.usage([output]), prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=prompt_ids, created=self.created)

    def _full_choice(self, completion: CompletionOutput) -> ChatChoice:
        message, finish_reason = self.message(completion)
        if echoed := self.request.echoed():
            message = message.model_copy(update={"content": echoed + (message.content or "")})
        return ChatChoice(index=completion.index, message=message, logprobs=self.logprobs(completion),
                          finish_reason=finish_reason, stop_reason=completion.stop_reason,
                          token_ids=self.token_ids(completion, 0))

    def token_ids(self, completion: CompletionOutput, first_token: int) -> list[int] | None:
        """vLLM's token_ids (with return_token_ids): the choice's tokens from `first_token` on."""
        return list(completion.token_ids[first_token:]) if self.request.return_token_ids and not self.hides_tokens \
            else None
