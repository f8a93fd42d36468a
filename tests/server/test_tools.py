"""Forced tool calls (tool_choice named or "required") map onto structured outputs; everything else is refused
with a sentence, never silently answered in text."""

import json

import pytest

from jaxserve.loader.chat_content import template_messages
from jaxserve.sampling_params import StructuredOutputsParams as S
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.errors import APIError
from jaxserve.server.request_bodies import build_sampling_params, chat_inputs
from jaxserve.server.tools import ToolChoice, parse_forced_calls, tool_choice_of, tool_constraint
from tests.server.helpers import REAL_MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_a_named_function_constrains_the_output_to_its_parameters():
    params = build_sampling_params(request(tools=TOOLS, tool_choice=NAMED))
    assert params.structured_outputs == S(json=WEATHER["function"]["parameters"], disable_additional_properties=True)
    assert params.structured_outputs.json["additionalProperties"] is False  # strict, as vLLM
    assert request(tools=TOOLS, tool_choice=NAMED).rendering()["tools"] == TOOLS  # the template sees them


def test_a_function_named_required_is_not_tool_choice_required():
    tools = [{"type": "function", "function": {"name": "required", "parameters": {"type": "integer"}}}]
    named = request(tools=tools, tool_choice={"type": "function", "function": {"name": "required"}})
    assert named.resolved_tool_choice() == ToolChoice("named", "required")
    assert build_sampling_params(named).structured_outputs == S(json={"type": "integer"},
                                                                disable_additional_properties=True)


def test_required_constrains_the_output_to_a_list_of_calls():
    schema = tool_constraint(ToolChoice("required"), TOOLS).json
    assert schema["type"] == "array" and schema["minItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {},
                                                                       "additionalProperties": False}


def test_required_without_parallel_calls_is_one_call(tokenizer):
    from jaxserve.core.grammar import GrammarCompiler

    params = build_sampling_params(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert params.structured_outputs.json["maxItems"] == 1
    call = '{"name": "get_time", "parameters": {}}'
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))

    def accepts(structured_outputs, text: str) -> bool:
        matcher = compiler.matcher(structured_outputs)
        return all(matcher.consume_token(token) for token in tokenizer.encode(text))

    parallel = build_sampling_params(request(tools=TOOLS, tool_choice="required")).structured_outputs
    assert accepts(parallel, f"[{call}, {call}]") and accepts(params.structured_outputs, f"[{call}]")
    assert not accepts(params.structured_outputs, f"[{call}, {call}]")


def test_tool_arguments_hold_only_the_properties_their_schema_lists(tokenizer):
    """vLLM's strict default: a named call may not add keys its parameters do not list (the model kept adding some
    until max_tokens, LangChain's named tool choice then got no call), unless the schema itself allows them."""
    from jaxserve.core.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))

    def accepts(tools, choice, text: str) -> bool:
        matcher = compiler.matcher(build_sampling_params(request(tools=tools, tool_choice=choice)).structured_outputs)
        return all(matcher.consume_token(token) for token in tokenizer.encode(text))

    assert accepts(TOOLS, NAMED, '{"city": "Paris"}')
    assert not accepts(TOOLS, NAMED, '{"city": "Paris", "unit"')
    assert not accepts(TOOLS, "required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit"')
    open_weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True}}}
    assert accepts([open_weather], NAMED, '{"city": "Paris", "unit"')


def test_none_ignores_even_tools_it_would_refuse():
    assert build_sampling_params(request(tools=[WEATHER, WEATHER], tool_choice="none")).structured_outputs is None


def test_none_and_auto_leave_the_output_free_and_the_template_sees_the_tools():
    for choice in ("none", "auto"):
        body = request(tools=TOOLS, tool_choice=choice)
        assert build_sampling_params(body).structured_outputs is None
        assert body.rendering()["tools"] == TOOLS  # as vLLM renders them
    assert tool_choice_of("auto", []) is None and tool_choice_of(None, None) is None


def test_auto_needs_a_tool_call_parser():
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as caught:
        chat_inputs(request(tools=TOOLS), lambda *a, **k: [1], {})
    assert caught.value.param == "tool_choice" and caught.value.status == 400


@pytest.mark.parametrize("fields, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}), 'tool_choice must be "none"'),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "given twice"),
    (dict(response_format={"type": "json_schema", "json_schema": "a schema"}), "json_schema.schema"),
    (dict(tools=TOOLS, tool_choice="sometimes"), 'tool_choice must be "none"'),
    (dict(tools=[{"type": "retrieval"}], tool_choice="required"), r"tools\[0\] must be"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}], tool_choice="required"),
     r"tools\[0\].function.name"),
    (dict(tools=TOOLS, tool_choice=NAMED, response_format={"type": "json_object"}), "cannot be combined"),
])
def test_refused_with_a_sentence(fields, words):
    with pytest.raises(APIError, match=words) as caught:  # a 400 naming the field, never a 500
        build_sampling_params(request(**fields))
    assert caught.value.status == 400 and caught.value.param in ("tools", "tool_choice", "response_format")


def test_calls_are_parsed_from_the_finished_text():
    named = parse_forced_calls(ToolChoice("named", "get_weather"), '{"city": "Paris"}')
    assert named[0].arguments == '{"city": "Paris"}'
    calls = parse_forced_calls(ToolChoice("required"), '[{"name": "get_time", "parameters": {}}, '
                                         '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert parse_forced_calls(ToolChoice("required"), '[{"name": "get_ti') is None  # cut before any name: text
    cut = parse_forced_calls(ToolChoice("required"), '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                                      '"parameters": {"ci')
    assert [(c.name, c.arguments) for c in cut] == [("get_time", "{}"), ("get_weather", '{"ci')]  # as generated
    assert parse_forced_calls(ToolChoice("named", "get_weather"), '{"ci')[0].arguments == '{"ci'
    body = calls[0].body(index=0)
    assert body["index"] == 0 and body["type"] == "function" and body["id"].startswith("call_")


def test_tool_call_arguments_in_the_history_reach_the_template_as_objects():
    history = request(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = template_messages(history.template_messages(), "", "string")
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    # Rendered for a template that reads strings, the call's empty turn is "" (loader/chat_content.py).
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"


# ---- on the real server ------------------------------------------------------------------------------------
def ask(client, max_completion_tokens=60, **kwargs):
    return client.chat.completions.create(model=REAL_MODEL, temperature=0, max_completion_tokens=max_completion_tokens,
                                          tools=TOOLS,
                                          messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                          **kwargs)


def test_named_tool_call_whole_and_streamed(openai_client):
    reply = ask(openai_client, tool_choice=NAMED)
    choice = reply.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert choice.message.content is None and choice.finish_reason == "stop" and call.id.startswith("call_")
    chunks = list(ask(openai_client, tool_choice=NAMED, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_calls_whole_and_streamed(openai_client):
    reply = ask(openai_client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                                 dict)
    chunks = list(ask(openai_client, tool_choice="required", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_forced_call_cut_by_max_tokens_is_still_a_tool_call(openai_client, tool_choice):
    """As vLLM answers: the call with its arguments as generated so far, and finish_reason "length", whole and
    streamed alike (LangChain and the Agents SDK look for tool_calls, not for text)."""
    whole = ask(openai_client, tool_choice=tool_choice)
    full_call = whole.choices[0].message.tool_calls[-1]
    budget = whole.usage.completion_tokens - 3  # stops inside the last call's arguments
    cut = ask(openai_client, tool_choice=tool_choice, max_completion_tokens=budget)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    call = choice.message.tool_calls[-1]
    assert call.function.name == full_call.function.name
    assert full_call.function.arguments.startswith(call.function.arguments) and \
        len(call.function.arguments) < len(full_call.function.arguments)
    chunks = list(ask(openai_client, tool_choice=tool_choice, max_completion_tokens=budget, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert "".join(t.function.arguments or "" for t in streamed if t.index == len(choice.message.tool_calls) - 1) \
        == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
