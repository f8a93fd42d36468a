"""POST /v1/responses through the OpenAI SDK, on the fake engine (scripted output, real tokenizer and template):
reasoning, text and function calls as output items, whole and streamed alike; conversations continued with
previous_response_id; stored responses retrieved and deleted; what a local model cannot do refused by name."""

import json

import httpx
import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread
from tests.server.test_reasoning_parsers import THOUGHT
from tests.server.test_tool_parsers import REPLY
from tests.server.test_tools import TOOLS

SCRIPT = f"<think>{THOUGHT}</think>{REPLY}"
# The Responses API's function tools are flat: {"type": "function", "name", "parameters"}.
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
STOP_AFTER_CALL = {"stop": ["</tool_call>"], "include_stop_str_in_output": True}  # vLLM's extras pass through


@pytest.fixture(scope="module")
def served(tokenizer):
    fake = FakeEngine(tokenizer, script_text=SCRIPT, step_delay=0)
    app = build_app(AsyncEngine(fake), tool_parser=HermesToolParser(),
                    reasoning_parser=reasoning_parser("qwen3", tokenizer))
    with serve_in_thread(app) as url:
        yield url, fake, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def create(client, **kwargs):
    return client.responses.create(model="fake-model", **{"input": "Weather in Paris?", "temperature": 0, **kwargs})


def test_reasoning_text_and_a_function_call_become_output_items(served):
    _, _, client = served
    response = create(client, tools=RESPONSE_TOOLS, extra_body=STOP_AFTER_CALL)
    reasoning, message, call = response.output
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and response.output_text == "Let me check. "
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    usage = response.usage
    assert usage.output_tokens == len(client_tokens(served, SCRIPT))
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"


def client_tokens(served, text):
    return served[1].tokenizer.encode(text)


def test_streamed_events_build_the_same_items(served):
    _, _, client = served
    whole = create(client, tools=RESPONSE_TOOLS, extra_body=STOP_AFTER_CALL)
    events = list(create(client, tools=RESPONSE_TOOLS, extra_body=STOP_AFTER_CALL, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    assert final.output_text == whole.output_text and final.output[0].content[0].text == THOUGHT
    # Deltas add up to their item's text, and name the item they belong to.
    by_id = {item.id: item for item in final.output}
    for delta_kind, item_type in (("response.reasoning_text.delta", "reasoning"),
                                  ("response.output_text.delta", "message"),
                                  ("response.function_call_arguments.delta", "function_call")):
        deltas = [e for e in events if e.type == delta_kind]
        assert deltas and {by_id[e.item_id].type for e in deltas} == {item_type}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == json.loads(final.output[2].arguments) == {"city": "Paris"}
    # Each item is announced, then done, one after another.
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [0, 1, 2] and [item.id for item in done] == [item.id for item in final.output]


def test_max_output_tokens_makes_it_incomplete(served):
    _, _, client = served
    response = create(client, max_output_tokens=6)  # cut short while thinking: the reasoning so far, no message
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 6 and [item.type for item in response.output] == ["reasoning"]
    assert THOUGHT.startswith(response.output[0].content[0].text) and response.output_text == ""
    assert response.output[0].status == "incomplete"
    events = list(create(client, max_output_tokens=6, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert [(item.type, item.status) for item in events[-1].response.output] == [("reasoning", "incomplete")]
    assert events[-1].response.output[0].content[0].text == response.output[0].content[0].text
    cut_answer = create(client, max_output_tokens=len(client_tokens(served, f"<think>{THOUGHT}</think>Let")))
    assert cut_answer.output[1].status == "incomplete" and cut_answer.output_text == "Let"


def test_a_conversation_continues_from_a_stored_response(served, tokenizer):
    url, fake, client = served
    first = create(client, tools=RESPONSE_TOOLS, instructions="Be brief.", extra_body=STOP_AFTER_CALL)
    call = first.output[2]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    second = create(client, input=[result], previous_response_id=first.id, tools=RESPONSE_TOOLS,
                    extra_body=STOP_AFTER_CALL)
    prompt = fake.prompts[second.id]
    text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    # The earlier turn (its question, its answer, the call's result) is in the prompt (SmolLM2's template writes
    # no tool calls); its instructions are not (OpenAI never carries them over).
    for part in ("Weather in Paris?", "Let me check.", "Sunny, 24 C"):
        assert part in text
    assert "Be brief." in (tokenizer.decode(fake.prompts[first.id]) if isinstance(fake.prompts[first.id], list)
                           else fake.prompts[first.id]) and "Be brief." not in text
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found") as missing:
        create(client, previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = create(client, store=False)
    assert httpx.get(f"{url}/v1/responses/{unstored.id}").status_code == 404


def test_input_items_become_chat_messages():
    """A turn's text and its calls are one assistant message (as chat templates expect), with the reasoning before
    it as reasoning_content; a call's output is a tool message; developer means system."""
    from jaxserve.server.responses_protocol import input_messages

    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Hm."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             call, call | {"call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    as_call = {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [as_call, as_call | {"id": "call_2"}],
         "reasoning_content": "Hm."},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    assert input_messages([call])[0] == {"role": "assistant", "content": "", "tool_calls": [as_call]}


def test_a_named_call_after_reasoning_streams_as_it_comes_whole(tokenizer):
    """tool_choice naming a function under a reasoning parser: the call is announced in the first chunk, before the
    reasoning; its item opens with its arguments, so streamed and whole give [reasoning, function_call]. Cut short
    by max_output_tokens, the call is incomplete either way."""
    import copy

    thinking = copy.deepcopy(tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    fake = FakeEngine(thinking, script_text=f'<think>{THOUGHT}</think>{{"city": "Paris"}} and more', step_delay=0)
    app = build_app(AsyncEngine(fake), reasoning_parser=reasoning_parser("qwen3", thinking))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(tools=RESPONSE_TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                      extra_body={"stop": ["}"], "include_stop_str_in_output": True})
        whole = create(client, **kwargs)
        streamed = list(create(client, stream=True, **kwargs))
        cut = len(thinking.encode(f'<think>{THOUGHT}</think>{{"city'))
        cut_whole = create(client, max_output_tokens=cut, **kwargs)
        cut_streamed = list(create(client, max_output_tokens=cut, stream=True, **kwargs))[-1].response
    final = streamed[-1].response
    for response in (whole, final):
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[0].content[0].text == THOUGHT
        call = response.output[1]
        assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    deltas = [e for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert {e.item_id for e in deltas} == {final.output[1].id}
    for response in (cut_whole, cut_streamed):
        assert response.status == "incomplete"
        assert [(item.type, item.status) for item in response.output] == [("reasoning", "completed"),
                                                                          ("function_call", "incomplete")]
        assert response.output[1].arguments == '{"city' and response.output[1].name == "get_weather"


def test_whole_calls_stay_completed_when_the_answer_is_cut_after_them(served):
    """tool_choice "auto": max_output_tokens cutting the text after a call leaves the response incomplete, and the
    call, read whole out of the text, completed, whole and streamed alike (it was "incomplete" whole)."""
    _, fake, client = served
    kwargs = dict(tools=RESPONSE_TOOLS, max_output_tokens=len(client_tokens(served, SCRIPT)) + 3)
    whole = create(client, **kwargs)
    streamed = list(create(client, stream=True, **kwargs))[-1].response
    for response in (whole, streamed):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert [(item.type, item.status) for item in response.output] == [
            ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
        assert json.loads(response.output[2].arguments) == {"city": "Paris"}


def test_the_store_keeps_the_latest_within_its_bounds():
    from jaxserve.server.response_store import ResponseStore

    store = ResponseStore(capacity=2, max_chars=10)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": "abc"}])
    assert store.get("r0") is None and store.get("r1") and store.get("r2")  # the oldest past the count
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 8}])  # 3 + 8 > 10 characters
    assert store.get("r2") is None and store.get("big")
    assert store.delete("big") and not store.delete("big") and store.get("big") is None


def test_json_schema_format_constrains_the_text(served):
    """text.format reaches the engine as the request's structured output (the fake engine shows the params)."""
    url, fake, client = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = create(client, text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
                      max_output_tokens=4)
    assert response.text.format.type == "json_schema"
    assert fake.sampling_params[response.id].structured_outputs.json == schema


def test_a_schema_the_grammar_compiler_refuses_names_text_format():
    """Errors about the schema name the field the client sent (they said response_format, which /v1/responses
    refuses as a misplaced field)."""
    from jaxserve.core.grammar import GrammarError
    from jaxserve.server.responses_protocol import ResponsesRequest

    body = ResponsesRequest.model_validate({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "string", "pattern": "(a"}}}})
    constraint = body.chat_request([])[0].to_sampling_params().structured_outputs
    error = GrammarError(constraint, "regex parse error:\n    (a\n    ^\nerror: unclosed group")
    assert str(error) == "text.format is invalid: regex parse error: (a error: unclosed group"
    assert error.param == "text"


def test_parallel_tool_calls_false_reaches_the_tool_choice(served):
    url, fake, client = served
    response = create(client, tools=RESPONSE_TOOLS, tool_choice="required", parallel_tool_calls=False,
                      max_output_tokens=4)
    assert response.parallel_tool_calls is False
    assert fake.sampling_params[response.id].structured_outputs.json["maxItems"] == 1  # one call at most


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "'input_image': only text parts"),
    ({"input": [{"type": "web_search_call"}]}, "input", "'web_search_call', which is not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "needs call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "store": None, "stream": None, "parallel_tool_calls": None}, None, None),  # nulls: defaults
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "text.format must be"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "is not supported"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs", "logprobs are not supported"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "logprobs are not supported"),
    ({"input": "x", "max_tokens": 5}, "max_tokens", "send max_output_tokens"),
    ({"input": "x", "response_format": {"type": "json_object"}}, "response_format", "send text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text", "needs its JSON schema"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools", "tools[0].name must be"),
])
def test_what_it_cannot_do_is_a_400_naming_the_field(served, body, param, message):
    url, _, _ = served
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    if message is None:
        assert reply.status_code == 200 and reply.json()["store"] is True and reply.json()["parallel_tool_calls"]
        return
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_the_real_model_answers_as_in_chat(openai_client):
    """SmolLM2 on the real server: a response's text is the chat completion's for the same messages, whole and
    streamed, and a JSON schema holds."""
    from tests.server.helpers import REAL_MODEL

    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is rain?"}]
    chat = openai_client.chat.completions.create(model=REAL_MODEL, messages=messages, temperature=0, max_tokens=12)
    response = openai_client.responses.create(model=REAL_MODEL, instructions=messages[0]["content"],
                                              input=messages[1]["content"], temperature=0, max_output_tokens=12)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    streamed = list(openai_client.responses.create(model=REAL_MODEL, instructions=messages[0]["content"],
                                                   input=messages[1]["content"], temperature=0, max_output_tokens=12,
                                                   stream=True))
    assert streamed[-1].response.output_text == response.output_text
    schema = {"type": "object", "properties": {"planet": {"type": "string"}, "moons": {"type": "integer"}},
              "required": ["planet", "moons"], "additionalProperties": False}
    shaped = openai_client.responses.create(model=REAL_MODEL, input="Name a planet and its number of moons.",
                                            temperature=0, max_output_tokens=40,
                                            text={"format": {"type": "json_schema", "name": "planet",
                                                             "schema": schema}})
    assert shaped.status == "completed" and set(json.loads(shaped.output_text)) == {"planet", "moons"}


def test_answers_are_what_the_openapi_document_says(served):
    """Every response object the server writes (whole, cut short, each streamed event's, a stored one retrieved)
    and the deletion notice validate against the schemas /openapi.json publishes, which forbid unlisted fields."""
    from jaxserve.server.responses_protocol import DeletedResponse, ResponseObject

    url, _, _ = served
    body = {"model": "fake-model", "input": "Weather in Paris?", "temperature": 0, "tools": RESPONSE_TOOLS,
            "instructions": "Be brief.", "metadata": {"k": "v"}, **STOP_AFTER_CALL}
    whole = httpx.post(f"{url}/v1/responses", json=body).json()
    answers = [whole, httpx.post(f"{url}/v1/responses", json={**body, "max_output_tokens": 6}).json(),
               httpx.get(f"{url}/v1/responses/{whole['id']}").json()]
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as streamed:
        events = [json.loads(line[len("data: "):]) for line in streamed.iter_lines() if line.startswith("data: {")]
    answers += [event["response"] for event in events if "response" in event]
    assert len(answers) >= 6 and {a["status"] for a in answers} == {"completed", "incomplete", "in_progress"}
    assert {item["type"] for item in whole["output"]} == {"reasoning", "message", "function_call"}
    for answer in answers:
        ResponseObject.model_validate(answer)
    DeletedResponse.model_validate(httpx.delete(f"{url}/v1/responses/{whole['id']}").json())
