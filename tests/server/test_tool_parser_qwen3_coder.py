"""The qwen3_coder tool-call parser: Qwen3-Coder's XML-style blocks, values typed by the request's tool schemas,
what is no call kept as content, and while streaming only what cannot change released; served whole and streamed."""

import json
import time

import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.tool_parsers import tool_call_parser
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "score": {"type": "number"},
    "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"},
    "code": {"type": "string"}, "after": {"type": ["string", "null"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [SEARCH, TIME]


def block(name: str, **parameters: str) -> str:
    inner = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


REPLY = "Let me look.\n" + block("search", query="jax 42", limit="3") + "\n" + block("get_time")
CALLS = [("search", {"query": "jax 42", "limit": 3}), ("get_time", {})]


def parsed(text: str, final: bool = True, tools=TOOLS):
    content, calls = tool_call_parser("qwen3_coder").for_tools(tools).split(text, final)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def test_blocks_give_calls_after_the_content():
    assert parsed(REPLY) == ("Let me look.\n", CALLS)


def test_values_take_the_type_their_schema_names():
    reply = block("search", query="42", limit="7", score="0.5", exact="True", filters='{"lang": ["en"]}',
                  tags="['a', 'b']", code="def f():\n    return 1\n", after="null")
    assert parsed(reply)[1] == [("search", {"query": "42", "limit": 7, "score": 0.5, "exact": True,
                                            "filters": {"lang": ["en"]}, "tags": ["a", "b"],
                                            "code": "def f():\n    return 1\n", "after": None})]


def test_types_come_from_anyof_oneof_enum_and_const_as_vllm_reads_them():
    """Pydantic writes Optional[int] as anyOf [integer, null]: the Agents SDK and LangChain send such schemas."""
    properties = {"limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                  "exact": {"oneOf": [{"type": "boolean"}, {"type": "string"}]},
                  "level": {"enum": [1, 2, 3]}, "mode": {"const": 4}, "either": {"type": ["string", "integer"]},
                  "spec": {"anyOf": [{"type": "object"}, {"type": "string"}]}, "none": {"anyOf": [{"type": "null"}]}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": properties}}}]
    reply = block("f", limit="5", exact="true", level="2", mode="4", either="7", spec="[1]", none="null")
    assert parsed(reply, tools=tools)[1] == [("f", {"limit": 5, "exact": True, "level": 2, "mode": 4, "either": 7,
                                                   "spec": "[1]", "none": None})]
    assert parsed(block("f", limit="null"), tools=tools)[1] == [("f", {"limit": None})]


def test_values_that_do_not_fit_their_type_or_have_none_stay_text():
    reply = block("search", limit="many", score="nan", filters="{broken", unknown="5")
    assert parsed(reply)[1] == [("search", {"limit": "many", "score": "nan", "filters": "{broken", "unknown": "5"})]
    assert parsed(reply, tools=None)[1] == [("search", {"limit": "many", "score": "nan", "filters": "{broken",
                                                        "unknown": "5"})]  # no schemas: every value is text


@pytest.mark.parametrize("reply", [
    "<tool_call>\n{\"name\": \"search\"}\n</tool_call>",  # hermes' JSON: not this format
    "<tool_call>\n<function=search>\nstray text<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",  # no </function>
])
def test_what_is_not_a_call_is_content_as_written(reply):
    assert parsed("Hi " + reply) == ("Hi " + reply, [])


def test_a_value_whose_closing_tag_is_missing_ends_at_the_next_parameter():
    reply = "<tool_call>\n<function=search>\n<parameter=query>\njax\n<parameter=limit>\n3\n</function>\n</tool_call>"
    assert parsed(reply)[1] == [("search", {"query": "jax", "limit": 3})]


def test_tools_of_the_wrong_shape_type_nothing_and_break_nothing():
    tools = [{"type": "function", "function": "search"}, "x",
             {"type": "function", "function": {"name": "search", "parameters": {"properties": ["limit"]}}}]
    assert parsed(block("search", limit="3"), tools=tools)[1] == [("search", {"limit": "3"})]


def test_streaming_content_only_grows_and_calls_are_only_added():
    for n in range(len(REPLY) + 1):
        content, calls = parsed(REPLY[:n], final=False)
        assert "Let me look.\n".startswith(content) and CALLS[: len(calls)] == calls, n
    assert parsed(REPLY[: REPLY.index("</tool_call>") + len("</tool_call>")], final=False)[1] == CALLS[:1]
    assert parsed("Paris <tool_", final=False) == ("Paris ", [])  # a marker's beginning is held back


def test_special_tokens_are_kept_in_the_text():
    assert tool_call_parser("qwen3_coder").adjust(SamplingParams()).skip_special_tokens is False
    assert tool_call_parser("qwen3_xml").for_tools(TOOLS).split(REPLY, True)[1][0].name == "search"


def test_served_whole_and_streamed_with_the_requests_schemas(tokenizer):
    engine = AsyncEngine(FakeEngine(tokenizer, script_text=REPLY, step_delay=0, ends_with_script=True))
    with serve_in_thread(build_app(engine, tool_parser=tool_call_parser("qwen3_coder"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        ask = dict(model="fake-model", messages=[{"role": "user", "content": "Search, then the time?"}], tools=TOOLS,
                   max_tokens=len(tokenizer.encode(REPLY)) + 5, temperature=0)
        choice = client.chat.completions.create(**ask).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [(i, name, arguments) for i, (name, arguments) in enumerate(CALLS)]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me look.\n"


def test_a_chat_whose_rendering_fails_stops_its_request(tokenizer):
    """The engine request starts before the response's rendering is built: if building it fails, the request is
    aborted, not left generating unread."""
    class BrokenParser:
        def adjust(self, params):
            return params

        def for_tools(self, tools):
            raise RuntimeError("broken")

    fake = FakeEngine(tokenizer, step_delay=0.05)
    engine = AsyncEngine(fake)
    with serve_in_thread(build_app(engine, tool_parser=BrokenParser())) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                           tools=TOOLS, max_tokens=200)  # 10 s of steps if it ran on
        deadline = time.monotonic() + 2
        while fake.has_unfinished_requests() and time.monotonic() < deadline:  # the abort reaches the loop thread
            time.sleep(0.01)
        assert engine.num_in_flight == 0 and not fake.has_unfinished_requests()
