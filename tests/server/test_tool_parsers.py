"""tool_choice "auto" with the hermes parser: tool calls read out of the model's text, whole and streamed."""

import json

import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.request_bodies import chat_inputs
from jaxserve.server.tool_parsers import tool_call_parser
from jaxserve.server.tool_parsers.hermes import HermesToolParser
from jaxserve.server.tools import ToolCall
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread
from tests.server.test_tools import TOOLS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = "Let me check. " + CALL


def test_calls_and_the_content_before_them():
    parser = HermesToolParser()
    text = f"Sure.\n{CALL}\n<tool_call>{{\"name\": \"get_time\"}}</tool_call>\nDone.\n\nNext"
    content, calls = parser.split(text, final=True)
    # As vLLM: the content is what comes before the first call; text between and after calls is not content.
    assert content == "Sure.\n" and calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]
    assert parser.split("no calls at all", final=True) == ("no calls at all", [])
    assert parser.split('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', final=True)[1] == \
        [ToolCall("f", '{"a": 1}')]  # unterminated at the end, arguments already JSON text


def test_what_is_not_a_call_stays_content():
    parser = HermesToolParser()
    for broken in ("<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"):
        assert parser.split("a " + broken, final=True) == ("a " + broken, [])
    assert parser.split(f"{CALL}<tool_call>oops</tool_call>", final=True) == \
        ("<tool_call>oops</tool_call>", [ToolCall("get_weather", '{"city": "Paris"}')])


def test_the_end_marker_inside_an_argument_does_not_end_the_call():
    parser = HermesToolParser()
    text = 'Here: <tool_call>{"name": "echo", "arguments": {"s": "a</tool_call>b"}}</tool_call> after'
    assert parser.split(text, final=True) == ("Here: ", [ToolCall("echo", '{"s": "a</tool_call>b"}')])
    cut = text[: text.index('b"}}')]  # ends with the marker inside the string: not settled, so held back
    assert cut.endswith("a</tool_call>") and parser.split(cut, final=False) == ("Here: ", [])


def test_while_streaming_only_what_cannot_change_is_released():
    parser = HermesToolParser()
    assert parser.split("Sure <tool_c", final=False) == ("Sure ", [])  # may open a call: held back
    assert parser.split("Sure <tool_c", final=True) == ("Sure <tool_c", [])
    assert parser.split("Sure " + CALL[:-5], final=False) == ("Sure ", [])  # the block is not closed yet
    released = [parser.split(REPLY[:n], final=False) for n in range(len(REPLY) + 1)]
    assert all(released[i][0] == released[-1][0][: len(released[i][0])] for i in range(len(released)))  # grows only
    assert released[-1] == ("Let me check. ", [ToolCall("get_weather", '{"city": "Paris"}')])


def test_an_unknown_parser_is_named():
    supported = ("granite, hermes, llama3_json, llama4_json, llama4_pythonic, mistral, phi4_mini_json, pythonic, "
                 "qwen3_coder, qwen3_xml, xlam")
    with pytest.raises(ValueError, match=f"'kimi_k2' is not supported; supported: {supported}"):
        tool_call_parser("kimi_k2")


@pytest.fixture(scope="module")
def auto_client(tokenizer):
    engine = AsyncEngine(FakeEngine(tokenizer, script_text=REPLY, step_delay=0))
    with serve_in_thread(build_app(engine, tool_parser=HermesToolParser())) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def ask(client, max_tokens=100, stop=("</tool_call>",), **kwargs):
    # The fake engine writes REPLY (from its start: greedy); the stop string ends it after the call, as EOS would.
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}],
                                          tools=TOOLS, max_tokens=max_tokens, stop=list(stop or []) or None,
                                          temperature=0,
                                          extra_body={"include_stop_str_in_output": True}, **kwargs)


def test_auto_tool_calls_whole_and_streamed(auto_client):
    choice = ask(auto_client).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = [c.choices[0] for c in ask(auto_client, stream=True) if c.choices]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content  # nothing of the markup leaks
    assert all(c.delta.content or c.delta.tool_calls or c.finish_reason or c.delta.role for c in chunks), \
        "a chunk with nothing in it"
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
        [(0, "get_weather", call.function.arguments)]
    assert chunks[-1].finish_reason == "tool_calls"


TWO_CALLS = REPLY + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def two_calls_client(tokenizer):
    engine = AsyncEngine(FakeEngine(tokenizer, script_text=TWO_CALLS, step_delay=0, ends_with_script=True))
    with serve_in_thread(build_app(engine, tool_parser=HermesToolParser())) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("parallel, names", [(None, ["get_weather", "get_time"]), (False, ["get_weather"])])
def test_parallel_tool_calls_false_keeps_the_first_call(two_calls_client, tokenizer, parallel, names):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    ask_for_both = dict(max_tokens=len(tokenizer.encode(TWO_CALLS)), stop=None, **extra)
    choice = ask(two_calls_client, **ask_for_both).choices[0]
    assert [call.function.name for call in choice.message.tool_calls] == names
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
    chunks = [c.choices[0] for c in ask(two_calls_client, stream=True, **ask_for_both) if c.choices]
    assert [t.function.name for c in chunks for t in c.delta.tool_calls or []] == names


def test_auto_without_a_call_is_plain_text(auto_client):
    choice = ask(auto_client, max_tokens=3).choices[0]  # cut before the call starts
    assert choice.message.content == "Let me check" and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_calls_before_a_length_cut_finish_as_length(auto_client, tokenizer):
    """As vLLM 0.34: a choice cut by max_tokens finishes "length" even with whole calls in it (the model may have
    been writing another), whole and streamed; the calls found are kept."""
    kwargs = dict(model="fake-model", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                  max_tokens=len(tokenizer.encode(REPLY)) + 3, temperature=0)  # the script goes on after the call
    choice = auto_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.name == "get_weather"
    chunks = [c.choices[0] for c in auto_client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[-1].finish_reason == "length"
    assert [call.function.name for c in chunks for call in c.delta.tool_calls or []] == ["get_weather"]


def test_auto_keeps_special_tokens_in_the_text():
    """Some tokenizers mark <tool_call> special: under "auto" the text keeps special tokens (vLLM's hermes does
    the same), or the parser would never see the markers."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    _, params = chat_inputs(body, lambda *a, **k: [1], {}, tool_parser=HermesToolParser())
    assert params.skip_special_tokens is False
