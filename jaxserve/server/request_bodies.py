"""Request body -> (prompts, SamplingParams), per endpoint: shared by the HTTP server and `jaxserve batch`.

One copy of this step is what makes a batch line answer exactly as the HTTP API would. Failures are APIErrors
carrying the status and OpenAI error body the HTTP API sends.
"""

from __future__ import annotations

from collections.abc import Callable

import pydantic

from jaxserve.errors import InvalidRequestField
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.errors import bad_request, from_validation_error, model_not_found
from jaxserve.server.protocol import CompletionRequest

Prompt = str | list[int]
ChatEncoder = Callable[..., list[int]]  # (messages, add_generation_prompt, **rendering) -> token ids


def with_cache_salt(prompt: Prompt, cache_salt: str | None) -> Prompt | dict:
    """The engine's prompt for a body's prompt and its vLLM cache_salt (the prefix cache is shared only between
    requests with the same salt): vLLM's prompt dict, or the prompt itself when there is no salt."""
    if cache_salt is None:
        return prompt
    return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "cache_salt": cache_salt}


def parse_request(schema: type[pydantic.BaseModel], body: dict):
    try:
        return schema.model_validate(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


def build_sampling_params(body, model_defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams (unset fields from the model's generation defaults); a 400 naming the field
    when a value is out of range."""
    return checked_params(body, lambda: body.to_sampling_params(model_defaults))


def checked_params(body, build):
    """`build()` (the engine's params for this body), with a ValueError turned into a 400 naming the field."""
    try:
        return build()
    except InvalidRequestField as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except ValueError as exc:
        field_name = str(exc).split(" ", 1)[0].split("[")[0]  # "tools[0].function.name ..." names tools
        raise bad_request(str(exc), param=field_name if field_name in type(body).model_fields else None) from None


def resolve_model_name(requested: str | None, served_model_names: list[str]) -> str:
    """The name to answer with; a 404 for a model that is not served."""
    if requested is None or requested == "":
        return served_model_names[0]
    if requested not in served_model_names:
        raise model_not_found(requested)
    return requested


def completion_inputs(body: CompletionRequest, model_defaults: dict, tokenizer
                      ) -> tuple[list[Prompt], SamplingParams | BeamSearchParams]:
    """POST /v1/completions: one engine prompt per entry of `prompt`, all with the same params (BeamSearchParams
    under use_beam_search); `tokenizer` encodes text prompts under `add_special_tokens: false`."""
    params = build_sampling_params(body, model_defaults)
    return body.prompts(tokenizer), checked_params(body, lambda: body.beam_search_params(params))


def chat_inputs(body: ChatCompletionRequest, encode_chat: ChatEncoder, model_defaults: dict,
                template_defaults: dict | None = None, tool_parser=None, reasoning_parser=None
                ) -> tuple[list[Prompt], SamplingParams | BeamSearchParams]:
    """POST /v1/chat/completions: the messages rendered through the chat template into one token-id prompt.
    `tool_parser`: how tool calls are read out of the text under tool_choice "auto" (None: "auto" is refused);
    `reasoning_parser`: how reasoning is read out of it (it may need the text's special tokens, and a grammar then
    starts after the reasoning).

    The params come first so that a bad value is reported before the (slower) template rendering.
    """
    params = build_sampling_params(body, model_defaults)
    choice = body.resolved_tool_choice()
    if choice is not None and choice.kind == "auto":
        if tool_parser is None:
            raise bad_request('tool_choice "auto" (the default when tools are given) needs a tool call parser, which '
                              'was not configured (serve --enable-auto-tool-choice --tool-call-parser hermes, or '
                              'tool_call_parser: hermes in a batch job); or set tool_choice to "required", to '
                              '{"type": "function", "function": {"name": ...}}, or to "none"', param="tool_choice")
        params = tool_parser.adjust(params)
    prompt = encode_chat(body.template_messages(), body.add_generation_prompt, **body.rendering(template_defaults))
    if reasoning_parser is not None:
        params = reasoning_parser.adjust(params, prompt)
    return [prompt], checked_params(body, lambda: body.beam_search_params(params))
