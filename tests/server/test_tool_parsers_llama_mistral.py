"""The llama3_json, pythonic, mistral, granite, phi4_mini_json and xlam tool-call parsers: calls read out of each family's format, what is not a call
kept as content, and while streaming only what cannot change released."""

import json
import re

import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from jaxserve.server.tool_parsers import tool_call_parser
from jaxserve.server.tools import ToolCall
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread
from tests.server.test_tools import TOOLS

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", "{}")

# (parser, the reply, its content, its calls): each family's own spelling of the same two calls.
REPLIES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [WEATHER]),
    ("llama3_json", '\n{"name": "get_weather", "parameters": {"city": "Paris"}} and then', "and then", [WEATHER]),
    ("pythonic", '[get_weather(city="Paris"), get_time()]', "", [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', "", [WEATHER]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "", [WEATHER, TIME]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Checking.", [WEATHER, TIME]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "", [WEATHER, TIME]),
    ("granite", ' <tool_call> [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [WEATHER]),
    ("granite", '[{"name": "get_time", "arguments": {}}]\nDone.', "Done.", [TIME]),
    ("granite", 'Let me check the weather.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Let me check the weather.", [WEATHER]),  # prose before the marker is the content (vLLM 0.34)
    ("phi4_mini_json", 'Checking. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_time", "parameters": {}}]', "Checking. ", [WEATHER, TIME]),
    ("xlam", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', "",
     [WEATHER, TIME]),
    ("xlam", 'Let me check.\n```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n```', "Let me check.\n",
     [WEATHER]),
    ("xlam", '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>\nDone.', "Done.", [TIME]),
    ("xlam", 'On it. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "On it. ", [TIME]),
    ("xlam", '\n[{"name": "get_time", "arguments": {}}]', "", [TIME]),  # a blank first: not sent, then taken back
    ("xlam", "\n[1, 2] are the numbers.", "\n[1, 2] are the numbers.", []),
]


@pytest.mark.parametrize("name, reply, content, calls", REPLIES)
def test_each_family_format_gives_its_calls(name, reply, content, calls):
    assert tool_call_parser(name).split(reply, final=True) == (content, calls)


@pytest.mark.parametrize("name, reply, content, calls", REPLIES)
def test_streaming_content_only_grows_and_calls_are_only_added(name, reply, content, calls):
    parser = tool_call_parser(name)
    sent = ""
    for n in range(len(reply) + 1):
        partial_content, partial_calls = parser.split(reply[:n], final=False)
        assert content.startswith(partial_content), (n, partial_content)
        assert partial_content.startswith(sent), (n, sent, partial_content)  # never taken back once released
        assert calls[: len(partial_calls)] == partial_calls, (n, partial_calls)
        sent = partial_content


def test_json_calls_are_released_as_each_object_closes():
    parser = tool_call_parser("llama3_json")
    first = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parser.split(first[:-1], final=False) == ("", [])
    assert parser.split(first + '; {"name": "get_ti', final=False) == ("", [WEATHER])
    assert parser.split(" \n", final=False) == ("", [])  # blanks, or a tag half-written: not yet decided
    assert parser.split("<|python_t", final=False) == ("", [])
    assert parser.split("Paris is", final=False) == ("Paris is", [])  # plain text streams at once


@pytest.mark.parametrize("name, reply", [
    ("llama3_json", "The weather in Paris is mild."),
    ("llama3_json", '{"answer": 42}'),  # JSON, but no call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),  # cut short
    ("llama3_json", 'Use {"name": "get_weather"}'),  # a reply that does not open with the call is text
    ("pythonic", "[1] Paris is the capital."),
    ("pythonic", '[get_weather("Paris")]'),  # positional arguments
    ("pythonic", '[get_weather(city=open("/etc/passwd"))]'),  # not a literal: never evaluated
    ("pythonic", "[get_weather(city={1, 2})]"),  # a set has no JSON form
    ("pythonic", "[brave_search.call(query='x')]"),
    ("pythonic", "[get_weather(city='Par"),
    ("mistral", "[TOOL_CALLS]get_weather"),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", 'No calls here, just [ARGS]{"a": 1}'),
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),  # Python's json reads it; no client would
    ("llama3_json", '{"name": "f", "parameters": 5}'),
    ("pythonic", "[f(x=1e999)]"),
    ("mistral", '[TOOL_CALLS]f[ARGS]"hello"'),  # arguments must be an object
    ("llama3_json", '{"name": "f", "arguments": "not json"}'),
    ("llama3_json", '{"name": "f", "parameters": {"n": ' + "9" * 5000 + "}}"),  # too long for Python's int()
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": "[TOOL_CALLS]b[ARGS]{}" tail'),  # cut inside a string: all of it is text
    ("granite", "[1] Paris is the capital."),  # a list, but of no calls
    ("granite", "<tool_call>[]"),
    ("granite", 'The answer: [{"name": "get_time", "arguments": {}}]'),  # a list after text is no call here
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": '),  # cut short
    ("phi4_mini_json", 'functools[{"name": "get_time", "arguments": {}}, 7]'),
    ("phi4_mini_json", "I will use functools to answer."),
    ("xlam", "Here:\n```python\nprint([1, 2])\n```"),  # a fence of code
    ("xlam", "```json\n[1, 2]\n```"),  # a list, but of no calls
    ("xlam", 'See <tool_call>[{"name": "get_time", "arguments": {'),  # cut short
    ("xlam", "Lists like [this] are text."),
    # JSON with a "name" but no arguments is an answer (response_format asked for a person), not a call
    ("llama3_json", '{"name": "Alice", "age": 30}'),
    ("xlam", '[{"name": "Alice", "age": 30}, {"name": "Bob", "age": 25}]'),
    ("granite", '[{"name": "Alice", "age": 30}]'),
    ("phi4_mini_json", 'functools[{"name": "Alice", "age": 30}]'),
])
def test_what_is_not_a_call_is_content_as_written(name, reply):
    assert tool_call_parser(name).split(reply, final=True) == (reply, [])


@pytest.mark.parametrize("name, opening", [
    ("hermes", "<tool_call>"), ("llama3_json", '{"name": "f", "parameters": '), ("pythonic", "[f(x="),
    ("mistral", "[TOOL_CALLS]"), ("mistral", '[TOOL_CALLS]f[ARGS]{"a": '), ("granite", "<tool_call>"),
    ("phi4_mini_json", "functools["), ("xlam", "```json\n")])
def test_nesting_too_deep_for_the_decoder_is_content_not_an_error(name, opening):
    """A thousand "[" take a model a few hundred tokens; Python's parsers give up with RecursionError."""
    reply = opening + "[" * 5000
    parser = tool_call_parser(name)
    assert parser.split(reply, final=False)[1] == []
    assert parser.split(reply, final=True) == (reply, [])


def test_a_mistral_marker_inside_an_argument_is_text():
    reply = '[TOOL_CALLS]echo[ARGS]{"s": "a[TOOL_CALLS]b"}[TOOL_CALLS]get_time[ARGS]{}'
    assert tool_call_parser("mistral").split(reply, final=True) == ("", [ToolCall("echo", '{"s": "a[TOOL_CALLS]b"}'),
                                                                         TIME])
    cut = reply[: reply.index('b"}')]  # the string is open: nothing is settled yet
    assert tool_call_parser("mistral").split(cut, final=False) == ("", [])


def test_a_malformed_call_after_good_ones_is_kept_as_content():
    mistral = tool_call_parser("mistral")
    reply = 'Hi[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]oops'
    assert mistral.split(reply, final=True) == ("Hi[TOOL_CALLS]oops", [WEATHER])
    assert mistral.split(reply, final=False) == ("Hi", [WEATHER])  # the last segment may yet parse


def test_json_list_calls_wait_for_the_list_to_close():
    granite, phi4 = tool_call_parser("granite"), tool_call_parser("phi4_mini_json")
    for undecided in (" ", "<|tool_", "<|tool_call|>", "<tool_call>\n"):  # may yet open a list of calls
        assert granite.split(undecided, final=False) == ("", [])
    assert granite.split("Paris is", final=False) == ("Paris is", [])  # plain text streams at once
    assert granite.split('[{"name": "get_time", "arguments": {}}', final=False) == ("", [])
    assert granite.split("[Python](https://py", final=False) == ("[Python](https://py", [])  # no calls: streams
    assert phi4.split("Try functools[ 3", final=False) == ("Try functools[ 3", [])
    assert granite.split('[{"name": "get_time", "arguments": {}}] Do', final=False) == ("", [TIME])
    assert phi4.split("Sure. functo", final=False) == ("Sure. ", [])  # the marker's beginning is held back
    assert phi4.split('Sure. functools[{"name": "get_time", "arguments": {}}] ok', final=False) == ("Sure. ", [TIME])
    xlam = tool_call_parser("xlam")
    assert xlam.split("Sure. ``", final=False) == ("Sure. ", [])  # a fence's beginning is held back
    assert xlam.split("Sure. ```js", final=False) == ("Sure. ", [])  # may yet be ```json
    assert xlam.split("Sure. ```py", final=False) == ("Sure. ```py", [])  # code: text at once


def test_pythonic_arguments_take_python_and_json_literals():
    reply = '[search(query="jax", limit=3, exact=True, filters={"lang": ["en", "fr"]}, after=null, strict=false)]'
    [call] = tool_call_parser("pythonic").split(reply, final=True)[1]
    assert call.name == "search" and json.loads(call.arguments) == {
        "query": "jax", "limit": 3, "exact": True, "filters": {"lang": ["en", "fr"]}, "after": None, "strict": False}


def test_mistral_call_ids_are_nine_letters_and_digits_and_markers_stay_in_the_text():
    parser = tool_call_parser("mistral")
    _, calls = parser.split('[TOOL_CALLS]get_time[ARGS]{}', final=True)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].body()["id"])  # Mistral's templates refuse other ids
    assert parser.adjust(SamplingParams()).skip_special_tokens is False
    assert tool_call_parser("llama3_json").adjust(SamplingParams()).skip_special_tokens is True


@pytest.mark.parametrize("name, reply, content, calls", [REPLIES[0], REPLIES[3], REPLIES[6]])
def test_served_whole_and_streamed(tokenizer, name, reply, content, calls):
    engine = AsyncEngine(FakeEngine(tokenizer, script_text=reply, step_delay=0, ends_with_script=True))
    with serve_in_thread(build_app(engine, tool_parser=tool_call_parser(name))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        ask = dict(model="fake-model", messages=[{"role": "user", "content": "Weather and time?"}], tools=TOOLS,
                   max_tokens=len(tokenizer.encode(reply)), temperature=0)
        choice = client.chat.completions.create(**ask).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
    assert choice.finish_reason == "tool_calls" and (choice.message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(c.name, c.arguments) for c in calls]
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
        [(i, c.name, c.arguments) for i, c in enumerate(calls)]
    assert "".join(c.delta.content or "" for c in chunks) == content and chunks[-1].finish_reason == "tool_calls"
