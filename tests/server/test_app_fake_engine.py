"""The HTTP layer over the fake engine: formats, errors, streaming, disconnects. Milliseconds per test."""

import contextlib
import copy
import json
import time

import httpx
import openai
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.chat_protocol import ChatCompletionRequest
from jaxserve.server.protocol import CompletionRequest
from jaxserve.server.response_bodies import OutputOptions
from jaxserve.server.uvicorn_server import DrainingServer
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import API_KEY, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tokenizer):
    fake = FakeEngine(tokenizer)
    engine = AsyncEngine(fake, max_waiting_requests=64)
    with serve_in_thread(build_app(engine, served_model_names=["fake", "alias"], api_key=API_KEY)) as url:
        yield url, fake, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0)


def post(server, path, body, headers=AUTH):
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server[0] + path, content=content, headers=headers, timeout=30)


def sse_payloads(response):
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def assert_error(response, status, error_type="invalid_request_error", param=None, contains=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and contains in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_completion_with_the_sdk(client, tokenizer):
    result = client.completions.create(model="fake", prompt="Hello there", max_tokens=5, temperature=0)
    choice = result.choices[0]
    assert choice.text == " one two three four five" and choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
    assert result.usage.completion_tokens == 5 and result.usage.total_tokens == result.usage.prompt_tokens + 5
    assert result.model == "fake"


def test_chat_with_the_sdk_streamed_equals_whole(client):
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model="alias", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="alias", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_multiple_prompts_and_n_give_indexed_choices(client):
    result = client.completions.create(model="fake", prompt=["a", [19556, 905]], n=2, max_tokens=3, seed=1)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.choices[0].text != result.choices[1].text
    assert result.usage.completion_tokens == 12


def test_streaming_multiple_prompts_with_usage_chunk(server):
    body = {"prompt": ["a", "b c"], "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, headers=AUTH) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    texts = {0: "", 1: ""}
    for payload in payloads[:-1]:
        for choice in payload["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: " one two three", 1: " one two three"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello there"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]}),
])
def test_return_token_ids_whole_and_streamed(server, tokenizer, path, body):
    """vLLM's return_token_ids: the prompt's ids (chat: at the top; completions: per choice) and each choice's
    generated ids; streamed, the prompt's in the first chunk only and each chunk's new ids, adding up."""
    def prompt_ids_of(payload):
        return (payload["choices"][0] if path == "/v1/completions" else payload)["prompt_token_ids"]

    body = {**body, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    whole = post(server, path, body).json()
    generated = whole["choices"][0]["token_ids"]
    assert len(prompt_ids_of(whole)) == whole["usage"]["prompt_tokens"] and len(generated) == 4
    assert tokenizer.decode(generated) == " one two three four"
    if path == "/v1/completions":
        assert prompt_ids_of(whole) == tokenizer.encode(body["prompt"])
    with httpx.stream("POST", server[0] + path, json={**body, "stream": True}, headers=AUTH) as response:
        chunks = sse_payloads(response)
    assert [prompt_ids_of(chunk) for chunk in chunks] == [prompt_ids_of(whole)] + [None] * (len(chunks) - 1)
    assert [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]] == generated
    assert post(server, path, {**body, "return_token_ids": None}).json()["choices"][0]["token_ids"] is None


def test_ignored_fields_are_named_in_the_log(server, caplog):
    caplog.set_level("WARNING", logger="jaxserve.server")
    response = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1, "max_tokns": 5, "vllm_xargs": {},
                                                "stream": True, "stream_options": {"include_usgae": False}})
    assert response.status_code == 200
    warnings = [record.getMessage() for record in caplog.records]
    assert "these fields of the request were ignored: max_tokns, vllm_xargs" in warnings
    assert "these fields of the request were ignored: include_usgae" in warnings


@pytest.mark.parametrize("path, body, request_class", [
    ("/v1/completions", {"prompt": "a b", "max_tokens": 3}, CompletionRequest),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, ChatCompletionRequest),
])
def test_a_null_optional_field_means_its_default(server, path, body, request_class):
    """OpenAI types these fields "X or null" and its SDK sends `"n": null` for a caller's n=None: vLLM reads a null
    as the default, where a strict schema answered 400 ("n: Input should be a valid integer")."""
    nulls = {name: None for name in request_class._null_means_default()}
    assert {"n", "stream", "presence_penalty", "frequency_penalty"} <= nulls.keys()
    expected = post(server, path, {**body, "temperature": 0}).json()
    answered = post(server, path, {**body, "temperature": 0, **nulls})
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"] == expected["choices"]
    assert post(server, path, {**body, "max_tokens": "three"}).status_code == 400  # a wrong type is still refused


@pytest.mark.parametrize("options, usage_chunk", [({}, True), ({"include_usage": False}, False), (None, False)])
def test_stream_options_ask_for_the_usage_chunk_unless_they_say_no(server, options, usage_chunk):
    """As vLLM: include_usage defaults to true once stream_options is sent at all."""
    body = {"prompt": "a", "max_tokens": 2, "stream": True, "stream_options": options}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, headers=AUTH) as response:
        payloads = sse_payloads(response)
    assert (payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 2) == usage_chunk


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a\x85b\u2028c\u2029d", "echo": True, "max_tokens": 2}),
    ("/v1/responses", {"input": "x", "instructions": "a\x85b\u2028c\u2029d", "max_output_tokens": 2}),  # echoed
])
def test_streamed_text_never_holds_a_line_break_other_than_the_events(server, path, body):
    """U+0085, U+2028 and U+2029 are line breaks to str.splitlines(): a client reading the stream by lines must not
    see an event cut in two."""
    response = post(server, path, {**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert len(events) == response.text.count("data: ") - (path == "/v1/completions")
    if path == "/v1/completions":
        assert events[0]["choices"][0]["text"].startswith(body["prompt"])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["a", "b c"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**body, "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": options}
    with httpx.stream("POST", server[0] + path, json=body, headers=AUTH) as response:
        payloads = sse_payloads(response)
    assert all(payload["usage"] is not None for payload in payloads)
    *chunks, last = payloads
    generated: dict[int, list[int]] = {}  # as vLLM: each chunk counts its own choice's tokens so far
    for chunk in chunks:
        generated.setdefault(chunk["choices"][0]["index"], []).append(chunk["usage"]["completion_tokens"])
    assert all(counts == sorted(counts) and counts[-1] == 3 for counts in generated.values())
    assert len(generated) == len(body.get("prompt", [0])) and last["usage"]["completion_tokens"] == 3 * len(generated)
    plain = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server[0] + path, json=plain, headers=AUTH) as response:
        assert all(payload["usage"] is None for payload in sse_payloads(response)[:-1])


def test_echo_with_logprobs(client, tokenizer):
    result = client.completions.create(model="fake", prompt="Hello there", max_tokens=2, echo=True, logprobs=2,
                                       temperature=0)
    choice = result.choices[0]
    prompt_len = len(tokenizer.encode("Hello there"))
    assert choice.text == "Hello there one two"
    lp = choice.logprobs
    assert len(lp.tokens) == prompt_len + 2 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])


def test_echoed_offsets_count_token_id_names_on_through_the_output(server):
    """With return_tokens_as_token_ids, offsets count the names' lengths, as vLLM counts them over the echoed
    prompt and the output in one pass: the output's restarted at the prompt text's length (going back)."""
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert all(token.startswith("token_id:") for token in whole["tokens"])
    names = whole["tokens"]
    assert whole["text_offset"] == [sum(len(t) for t in names[:i]) for i in range(len(names))]
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as response:
        chunks = [c["choices"][0]["logprobs"] for c in sse_payloads(response) if c["choices"]]
    assert [offset for lp in chunks for offset in lp["text_offset"]] == whole["text_offset"]


def test_echo_with_max_tokens_0_gives_the_prompt_and_its_logprobs_alone(server, tokenizer):
    """vLLM's echo_without_generation: how scoring tools (lm-evaluation-harness) ask for a prompt's logprobs."""
    body = {"prompt": "Hello there", "echo": True, "max_tokens": 0, "logprobs": 1}
    whole = post(server, "/v1/completions", body).json()
    choice = whole["choices"][0]
    assert choice["text"] == "Hello there" and whole["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode("Hello there"))
    assert choice["logprobs"]["token_logprobs"][0] is None
    with httpx.stream("POST", server[0] + "/v1/completions", headers=AUTH,
                      json={**body, "stream": True, "stream_options": {}}) as response:
        chunks = sse_payloads(response)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello there"
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, param="max_tokens")


def test_streamed_text_offsets_are_the_whole_responses_when_text_is_held_back(server):
    """A token held back as a possible stop string's beginning still sends its logprobs: the next chunk's offsets
    continue after it, as the whole response's do."""
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 1, "stop": [" twoX"]}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as response:
        chunks = [c["choices"][0]["logprobs"] for c in sse_payloads(response) if c["choices"]]
    assert [offset for lp in chunks for offset in lp["text_offset"]] == whole["text_offset"] == [0, 4, 8, 14]


def test_one_created_time_for_every_chunk(server, monkeypatch):
    ticks = iter(range(1_000_000, 2_000_000, 7))
    monkeypatch.setattr(time, "time", lambda: float(next(ticks)))  # every reading of the clock a new second
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {**body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server[0] + path, json=body, headers=AUTH) as response:
            assert len({chunk["created"] for chunk in sse_payloads(response)}) == 1, path


@pytest.mark.parametrize("body, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "n": 1, "best_of": 2}, "best_of"),
    ({"stop": [f"s{i}" for i in range(257)]}, "stop"),
])
def test_vllms_streaming_and_stop_limits_are_400s(server, body, param):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, **body}), 400, param=param)


def test_chat_logprobs(client):
    result = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)


def test_tokens_as_ids_name_logprob_tokens_by_id(tokenizer):
    """--return-tokens-as-token-ids: every token a logprobs field names is "token_id:N", the sampled ones and the
    alternatives, in both formats; usage has no prompt_tokens_details unless asked for."""
    app = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)), served_model_names=["fake"],
                    output_options=OutputOptions(tokens_as_ids=True))
    with serve_in_thread(app) as url:
        ids_client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        completion = ids_client.completions.create(model="fake", prompt="Hello there", max_tokens=2, echo=True,
                                                   logprobs=2, temperature=0)
        chat = ids_client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
        plain = ids_client.completions.create(model="fake", prompt="Hello there", max_tokens=2, logprobs=1,
                                              temperature=0, extra_body={"return_tokens_as_token_ids": False})
    assert plain.choices[0].logprobs.tokens == [" one", " two"]  # the request's own false wins, as in vLLM
    expected = [f"token_id:{t}" for t in tokenizer.encode("Hello there one two")]
    assert completion.choices[0].logprobs.tokens == expected
    assert all(key.startswith("token_id:") for top in completion.choices[0].logprobs.top_logprobs[1:] for key in top)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in tokenizer.encode(" one two three")]
    assert all(alt.token.startswith("token_id:") for entry in content for alt in entry.top_logprobs)
    assert completion.usage.prompt_tokens_details is None and chat.usage.prompt_tokens_details is None


def test_response_role_and_forced_usage_options(tokenizer):
    """--response-role names chat replies after a generation prompt (a continued message keeps its own role, as
    vLLM's); --enable-force-include-usage makes every stream report its usage, per chunk and at the end."""
    app = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0)), served_model_names=["fake"],
                    output_options=OutputOptions(response_role="bot", force_include_usage=True))
    chat = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    with serve_in_thread(app) as url:
        whole = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).json()
        continued = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            **chat, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
            "add_generation_prompt": False, "continue_final_message": True}).json()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}) as response:
            chunks = sse_payloads(response)
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2,
                                                                 "stream": True}) as response:
            completion_chunks = sse_payloads(response)
    assert whole["choices"][0]["message"]["role"] == "bot" and chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert continued["choices"][0]["message"]["role"] == "assistant"
    for stream in (chunks, completion_chunks):
        assert stream[-1]["choices"] == [] and stream[-1]["usage"]["completion_tokens"] == 2
        assert all(chunk["usage"] is not None for chunk in stream)


def test_stop_string(client):
    result = client.completions.create(model="fake", prompt="x", max_tokens=10, temperature=0, stop=[" four"])
    assert result.choices[0].text == " one two three" and result.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, contains", [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "JSON object"),
    ({"prompt": 3}, "prompt", "prompt must be a string"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
    ({"prompt": "x", "n": 0}, "n", "n must be >= 1"),
    ({"prompt": "x", "max_tokens": 1000}, "max_tokens", "1000"),
    ({"prompt": "x", "logprobs": 21}, None, "logprobs"),
    ({"prompt": "x", "seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),  # vLLM's int64 range
])
def test_validation_errors_are_400(server, body, param, contains):
    error = assert_error(post(server, "/v1/completions", body), 400, param=param, contains=contains)
    if body == {"prompt": "x", "max_tokens": 1000}:
        assert "256" in error["message"]  # names both the context length and max_tokens


def test_chat_validation_errors_are_400(server):
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"content": "no role"}]}), 400)
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400,
                 param="top_logprobs")
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}), 400,
                 param="top_logprobs")
    assert_error(post(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}), 400,
                 param="max_completion_tokens", contains="max_completion_tokens must be >= 1 or None, got 0")
    # As vLLM: top_logprobs 0 asks for no alternatives, so it needs no logprobs.
    zero = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0,
                                                 "max_tokens": 1})
    assert zero.status_code == 200 and zero.json()["choices"][0]["logprobs"] is None


def _deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_SCHEMA = _deep_schema(300)


@pytest.mark.parametrize("path, extra, param, contains", [
    ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format", "'grammar' is not supported"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_json",
     "cannot be combined with guided_choice"),
    ("/v1/completions", {"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     "--enable-auto-tool-choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}], "function_call": "auto"}, "functions",
     "function_call"),
    # nested past vLLM's 64 levels: a 400, not a RecursionError's 500 (closing its objects walked it recursively)
    ("/v1/completions", {"structured_outputs": {"json": DEEP_SCHEMA, "disable_additional_properties": True}},
     "structured_outputs", "nested too deeply: objects and arrays may nest at most 64 levels"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}],
                              "tool_choice": "required"}, "tools", "nested too deeply"),
])
def test_unsupported_or_invalid_output_constraints_are_400_not_ignored(server, path, extra, param, contains):
    """Unknown fields are ignored, but these change what a correct answer is: ignoring them would hand free text
    to a client that parses JSON or waits for a tool call."""
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    assert_error(post(server, path, {**body, **extra}), 400, param=param, contains=contains)


def test_text_output_and_declined_tools_are_served(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    for extra in ({"response_format": {"type": "text"}}, {"tools": [], "tool_choice": "auto"},
                  {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}):
        assert post(server, "/v1/chat/completions", {**chat, **extra}).status_code == 200, extra


def test_api_key_errors_are_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = assert_error(post(server, "/v1/completions", {"prompt": "x"}, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    assert httpx.get(server[0] + "/health").status_code == 200  # open routes need no key


def test_unknown_model_and_route_are_404(server, client):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, param="model",
                 contains="gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert_error(httpx.get(server[0] + "/v2/nothing", headers=AUTH), 404, error_type="not_found_error")
    assert_error(httpx.get(server[0] + "/nothing"), 404, error_type="not_found_error")


def test_models_tokenize_detokenize_version(server, tokenizer):
    models = httpx.get(server[0] + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["fake", "alias"] and models["data"][0]["max_model_len"] == 256
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": tokenizer.encode("Hello world")}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, param="tokens")
    assert httpx.get(server[0] + "/version").json()["version"]


def test_metrics_count_tokens_and_latencies(server, client):
    client.completions.create(model="fake", prompt="Hello", max_tokens=4)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "num_preemptions_total"):
        assert f"jaxserve:{name}" in text
    generated = [line for line in text.splitlines() if line.startswith("jaxserve:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 4


def test_metrics_series_exist_from_the_start_with_vllms_buckets_and_count_each_sample(tokenizer):
    """Every finish reason's series is there before its first request (rate() sees that request); each histogram
    has vLLM's buckets (a dashboard's le="60.0" exists, an hour-long request lands below +Inf); an n=2 request
    counts as two finished requests, as vLLM counts its child requests."""
    app = build_app(AsyncEngine(FakeEngine(tokenizer)), vllm_metric_names=True)
    with serve_in_thread(app) as url:
        fresh = httpx.get(url + "/metrics").text
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "n": 2}).status_code == 200
        after = httpx.get(url + "/metrics").text
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="fake-model"}} 0.0' in fresh
    assert 'vllm:prompt_tokens_total{model_name="fake-model"} 0.0' in fresh
    for name, bound in (("e2e_request_latency_seconds", "7680.0"), ("e2e_request_latency_seconds", "60.0"),
                        ("time_to_first_token_seconds", "2560.0"), ("inter_token_latency_seconds", "0.025")):
        assert f'vllm:{name}_bucket{{le="{bound}",model_name="fake-model"}}' in fresh
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 2.0' in after
    assert 'vllm:e2e_request_latency_seconds_count{model_name="fake-model"} 2.0' in after


def test_vllm_metric_names(tokenizer):
    """serve --vllm-metric-names: every series is vllm:NAME, for dashboards and autoscalers written for vLLM."""
    app = build_app(AsyncEngine(FakeEngine(tokenizer)), vllm_metric_names=True)
    with serve_in_thread(app) as url:
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        series = [line for line in httpx.get(url + "/metrics").text.splitlines() if not line.startswith("#")]
    assert series and all(line.startswith("vllm:") for line in series)
    assert any(line.startswith('vllm:num_requests_waiting{model_name="fake-model"}') for line in series)
    assert any(line.startswith("vllm:generation_tokens_total") and float(line.split()[-1]) == 2 for line in series)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    url, fake, engine = server
    fake.step_delay = 0.02
    try:
        body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 5
        while engine.stats()["free_blocks"] != fake.total_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.aborted and fake.aborted[-1].startswith("cmpl-")
        assert engine.stats()["free_blocks"] == fake.total_blocks
    finally:
        fake.step_delay = 0.002


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    url, fake, engine = server
    fake.step_delay = 0.02
    aborted_before = len(fake.aborted)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=0.3,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200})
        deadline = time.monotonic() + 5
        while len(fake.aborted) == aborted_before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.aborted[-1].startswith("chatcmpl-")
    finally:
        fake.step_delay = 0.002


def test_queue_full_is_503_with_retry_after(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0.5)
    engine = AsyncEngine(fake, max_waiting_requests=1)
    with serve_in_thread(build_app(engine)) as url:
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}):
            response = httpx.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2})
    error = assert_error(response, 503, error_type="server_error", contains="overloaded")
    assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"


def test_engine_failure_mid_stream_is_an_error_event_then_done(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0.02)
    engine = AsyncEngine(fake)
    with serve_in_thread(build_app(engine)) as url:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(lines)
            fake.fail_next_step = True
            rest = [line for line in lines if line]
        assert first.startswith("data: {")
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["type"] == "server_error" and "simulated device failure" in error["message"]
        assert_error(httpx.get(url + "/health"), 503, error_type="server_error")
        assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 500, error_type="server_error")


def test_shutdown_lets_requests_drain_then_ends_the_rest_with_an_error_event(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0.02)
    engine = AsyncEngine(fake)
    server = DrainingServer(build_app(engine), engine, log_level="warning", drain_seconds=0.5)
    with serve_in_thread(server) as url:
        body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)
            server.should_exit = True  # what Ctrl-C does
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert len(rest) > 10  # it ran on through the drain period before being stopped
    assert fake.aborted and not engine.is_healthy


def test_tokenize_messages_counts_like_chat_usage(server, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    counted = post(server, "/tokenize", {"messages": messages}).json()["count"]
    result = client.chat.completions.create(model="fake", messages=messages, max_tokens=1)
    assert result.usage.prompt_tokens == counted
    assert_error(post(server, "/tokenize", {"messages": [{"content": "no role"}]}), 400)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "fake", "prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_model_generation_defaults_fill_unset_sampling_fields(server, monkeypatch, path, body):
    """generation_config.json's temperature/top_k apply when the request leaves them out; the request wins."""
    _, fake, _ = server
    seen = []
    prepare = fake.prepare_request
    monkeypatch.setattr(fake, "generation_defaults", {"temperature": 0.25, "top_k": 7})
    monkeypatch.setattr(fake, "prepare_request", lambda rid, prompt, params, **kw: (
        seen.append(params), prepare(rid, prompt, params, **kw))[1])
    assert post(server, path, body).status_code == 200
    assert post(server, path, body | {"temperature": 0, "top_k": 3}).status_code == 200
    assert [(p.temperature, p.top_k) for p in seen] == [(0.25, 7), (0.0, 3)]


def test_continue_final_message_and_chat_template_kwargs_reach_the_template(server):
    """vLLM's chat extras: the last assistant message left open, and template variables (Qwen3's
    enable_thinking is the common one); /tokenize renders the same way as chat completions."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": conversation, "add_generation_prompt": False, "continue_final_message": True,
            "return_token_strs": True}
    reply = post(server, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    assert "".join(reply.json()["token_strs"]).endswith("ĠI" + "Ġam")  # ends inside the assistant's message
    chat = {"messages": conversation, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    assert post(server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"] == reply.json()["count"]
    assert_error(post(server, "/v1/chat/completions", {**chat, "add_generation_prompt": True}), 400,
                 contains="cannot both be true")
    assert_error(post(server, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"tokenize": False}}), 400,
                 contains="may not set tokenize")
    # SmolLM2's template reads no extra variables, so one it does not know changes nothing.
    plain = {"messages": conversation[:1], "max_tokens": 2}
    counted = post(server, "/v1/chat/completions", {**plain, "chat_template_kwargs": {"enable_thinking": False}})
    assert counted.json()["usage"] == post(server, "/v1/chat/completions", plain).json()["usage"]


def test_server_default_chat_template_kwargs_under_the_requests_own(tokenizer):
    """--default-chat-template-kwargs: variables every chat renders with, unless the request sets its own."""
    own = copy.deepcopy(tokenizer)
    own.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if thinking %} and think{% endif %}"
    app = build_app(AsyncEngine(FakeEngine(own)), default_chat_template_kwargs={"thinking": True})
    chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    with serve_in_thread(app) as url:
        def rendered(extra):
            reply = httpx.post(url + "/tokenize", json={**chat, **extra})
            assert reply.status_code == 200, reply.text
            prompt_tokens = httpx.post(url + "/v1/chat/completions", json={**chat, **extra, "max_tokens": 1})
            assert prompt_tokens.json()["usage"]["prompt_tokens"] == reply.json()["count"]  # chat renders alike
            return own.decode(reply.json()["tokens"])

        assert rendered({}) == "hi and think"
        assert rendered({"chat_template_kwargs": {"thinking": False}}) == "hi"


@contextlib.contextmanager
def chats_rendered_by(tokenizer, template: str):
    """A server over the fake engine whose chat template is `template`: yields rendered(extra fields) -> the prompt
    a chat of the one user message "hi" (and those fields) gave the engine, as text."""
    own = copy.deepcopy(tokenizer)
    own.chat_template = template
    fake = FakeEngine(own)
    chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False, "max_tokens": 1}
    with serve_in_thread(build_app(AsyncEngine(fake))) as url:
        def rendered(extra):
            reply = httpx.post(url + "/v1/chat/completions", json={**chat, **extra})
            assert reply.status_code == 200, reply.text
            return own.decode(list(fake.prompts.values())[-1])  # the latest request's prompt

        yield rendered


def test_reasoning_effort_reaches_the_chat_template(tokenizer):
    """OpenAI's reasoning_effort is a template variable, as in vLLM (gpt-oss and others read it); the request's own
    chat_template_kwargs win."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if reasoning_effort %} effort " \
               "{{ reasoning_effort }}{% endif %}"
    with chats_rendered_by(tokenizer, template) as rendered:
        assert rendered({}) == "hi"
        assert rendered({"reasoning_effort": "high"}) == "hi effort high"
        assert rendered({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}) == \
            "hi effort low"
    # and, as vLLM, an effort sets enable_thinking (Qwen3's switch): "none" turns thinking off
    thinking = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined %} " \
               "thinking={{ enable_thinking }}{% endif %}"
    with chats_rendered_by(tokenizer, thinking) as rendered:
        assert rendered({}) == "hi"
        assert rendered({"reasoning_effort": "none"}) == "hi thinking=False"
        assert rendered({"reasoning_effort": "low"}) == "hi thinking=True"
        assert rendered({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}) == \
            "hi thinking=True"


def test_documents_reach_the_chat_template(tokenizer):
    """vLLM's `documents` (retrieved passages for a RAG template): the template variable of that name."""
    template = "{% for d in documents or [] %}[{{ d['text'] }}]{% endfor %}{% for m in messages %}" \
               "{{ m['content'] }}{% endfor %}"
    with chats_rendered_by(tokenizer, template) as rendered:
        assert rendered({"documents": [{"title": "a", "text": "Paris"}]}) == "[Paris]hi"


@pytest.mark.parametrize("path, body, prefix", [
    ("/v1/completions", {"prompt": "Hello"}, "cmpl-"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chatcmpl-"),
])
def test_a_request_id_in_the_body_names_the_response(server, path, body, prefix):
    """vLLM's `request_id`: the response's id is the endpoint's prefix and it, whole and in every chunk."""
    body = {**body, "max_tokens": 2, "request_id": "order-17"}
    assert post(server, path, body).json()["id"] == f"{prefix}order-17"
    with httpx.stream("POST", server[0] + path, json={**body, "stream": True}, headers=AUTH, timeout=30) as reply:
        assert {chunk["id"] for chunk in sse_payloads(reply)} == {f"{prefix}order-17"}


def test_a_request_id_may_come_again_while_its_first_request_runs(tokenizer):
    """A retry under the same name (or a gateway's reused X-Request-Id) is served, both answering with it: the
    engine runs each under a name of its own (vLLM's too)."""
    slow = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0.1)), served_model_names=["fake"])
    body = {"prompt": "Hello", "max_tokens": 10, "request_id": "twice"}
    with serve_in_thread(slow) as url, httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                                                    timeout=30) as running:
        lines = running.iter_lines()  # kept: a generator dropped closes the response, reading it to the end
        assert '"id": "cmpl-twice"' in next(lines)  # admitted: its first chunk came
        again = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and again.json()["id"] == "cmpl-twice"
        assert again.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, prefix", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "request_id": "in-body"}, "cmpl-"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, "chatcmpl-"),
    ("/v1/embeddings", {"input": "Hello"}, "embd-"),
])
def test_the_x_request_id_header_names_the_response(tokenizer, path, body, prefix):
    """vLLM's: a client's X-Request-Id names the response (over the body's request_id), whatever
    --enable-request-id-headers says (that flag only puts it on the response's headers)."""
    app = build_app(AsyncEngine(FakeEngine(tokenizer)), served_model_names=["fake"])
    with serve_in_thread(app) as url:
        reply = httpx.post(url + path, json=body, headers={"X-Request-Id": "trace-9"}, timeout=30)
        assert reply.status_code == 200 and reply.json()["id"] == f"{prefix}trace-9", reply.text


def test_a_request_s_own_return_tokens_as_token_ids(server, tokenizer):
    """vLLM's per-request `return_tokens_as_token_ids`: that request's logprobs name tokens by id, others not."""
    body = {"prompt": "Hello there", "max_tokens": 2, "logprobs": 1, "temperature": 0}
    by_id = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()
    assert by_id["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in tokenizer.encode(" one two")]
    assert post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"] == [" one", " two"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True, "temperature": 0,
            "return_tokens_as_token_ids": True}
    content = post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in tokenizer.encode(" one two")]


def test_chat_echo_repeats_the_message_the_reply_goes_on_from(server):
    """vLLM's chat `echo`: with the last message the assistant's (continue_final_message), the reply's content
    begins with it, whole and streamed; a reply to a user message repeats nothing; with tools it is a 400."""
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    body = {"messages": conversation, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 2, "temperature": 0, "echo": True}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert whole == "Hello, I am one two"
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=30) as reply:
        chunks = sse_payloads(reply)
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == whole
    user_last = {"messages": conversation[:1], "max_tokens": 2, "temperature": 0}
    assert post(server, "/v1/chat/completions", {**user_last, "echo": True}).json()["choices"][0]["message"] == \
        post(server, "/v1/chat/completions", user_last).json()["choices"][0]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert_error(post(server, "/v1/chat/completions", {**body, "tools": tools}), 400,
                 contains="echo cannot be combined with tools")


def test_add_special_tokens_false_encodes_a_completion_prompt_without_them(tokenizer):
    """vLLM's `add_special_tokens`: false leaves out what the tokenizer adds itself (a BOS here), for prompts that
    already hold their special tokens; chat's prompt is the template's, so true there is refused by name."""
    from tokenizers.processors import TemplateProcessing

    own = copy.deepcopy(tokenizer)  # a tokenizer that adds a BOS, as Llama 3's does
    own.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                              special_tokens=[("<|endoftext|>", 0)])
    text_ids = own("Hello there", add_special_tokens=False)["input_ids"]
    fake = FakeEngine(own)
    with serve_in_thread(build_app(AsyncEngine(fake))) as url:
        def prompt_tokens(extra):
            reply = httpx.post(url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 1, **extra})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"]

        assert prompt_tokens({}) == len(text_ids) + 1  # the engine encodes the text, BOS and all
        assert prompt_tokens({"add_special_tokens": False}) == len(text_ids)
        assert list(fake.prompts.values())[-1] == text_ids  # encoded without it, the ids went to the engine
        chat = {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True}
        assert_error(httpx.post(url + "/v1/chat/completions", json=chat), 400, param="add_special_tokens",
                     contains="add_special_tokens true is not supported in chat")


def test_a_chat_template_in_the_request_is_refused_by_name(server):
    """Not ignored: the prompt would differ from the one the client wrote its template for."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ messages }}"}
    assert_error(post(server, "/v1/chat/completions", body), 400, param="chat_template",
                 contains="chat_template in a request is not supported")


def test_tools_reach_the_template_in_chat_and_tokenize_alike(tokenizer):
    own = copy.deepcopy(tokenizer)
    own.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" \
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with serve_in_thread(build_app(AsyncEngine(FakeEngine(own)))) as url:
        tokenized = httpx.post(url + "/tokenize", json=chat).json()
        assert own.decode(tokenized["tokens"]) == "[lookup]hi"
        reply = httpx.post(url + "/v1/chat/completions", json={**chat, "tool_choice": "none", "max_tokens": 1})
        assert reply.json()["usage"]["prompt_tokens"] == tokenized["count"]


BEAM_REFUSALS = [({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"), ({"best_of": 4}, "best_of"),
                 ({"presence_penalty": 0.5}, "presence_penalty"), ({"min_tokens": 2}, "min_tokens"),
                 ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
                 ({"response_format": {"type": "json_object"}}, "response_format")]


@pytest.mark.parametrize("extra, field", BEAM_REFUSALS)
def test_beam_search_refuses_by_name_what_it_would_ignore(server, extra, field):
    body = {"model": "fake", "prompt": "Hi", "use_beam_search": True, "n": 2, **extra}
    assert_error(post(server, "/v1/completions", body), 400, param=field, contains="use_beam_search")


def test_beam_search_refuses_forced_tool_calls_and_too_wide_beams(server):
    from tests.server.test_tools import TOOLS

    body = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True,
            "tools": TOOLS, "tool_choice": "required"}
    assert_error(post(server, "/v1/chat/completions", body), 400, param="tool_choice", contains="use_beam_search")
    body = {"model": "fake", "prompt": "Hi", "use_beam_search": True, "n": 11}  # ranks 22 logprobs, 20 returned
    assert_error(post(server, "/v1/completions", body), 400, contains="max_logprobs")


def test_beam_search_answers_n_choices(client, server):
    result = client.completions.create(model="fake", prompt="Hello there", max_tokens=3, n=2,
                                       extra_body={"use_beam_search": True})
    assert [choice.index for choice in result.choices] == [0, 1]
    assert [choice.finish_reason for choice in result.choices] == ["length", "length"]
    assert result.choices[0].text == " one one one"  # the fake's greedy token is always its script's first
    assert result.usage.completion_tokens == 6


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": "Hello"}), ("/classify", {"input": "Hello"}),
    ("/score", {"text_1": "a", "text_2": "b"}),
])
def test_pooling_requests_pass_their_cache_salt_to_the_engine(tokenizer, path, body):
    """vLLM's cache_salt on pooling requests too: only requests with the same salt share prefix-cache blocks (it
    was dropped, with a log line)."""
    fake = FakeEngine(tokenizer)
    with serve_in_thread(build_app(AsyncEngine(fake))) as url:
        reply = httpx.post(url + path, json={**body, "cache_salt": "tenant-a"}, timeout=30)
    assert reply.status_code in (200, 400), reply.text  # the fake embeds; /classify and /score it may refuse
    assert fake.prompts and all(isinstance(p, dict) and p["cache_salt"] == "tenant-a" for p in fake.prompts.values())
