"""Acceptance: /v1/chat/completions on the real server with SmolLM2."""

import json

import httpx
import openai
import pytest

from tests.server.helpers import REAL_MODEL

MESSAGES = [{"role": "user", "content": "Name one planet of the solar system."}]


def chat(client, **kwargs):
    kwargs.setdefault("model", REAL_MODEL)
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_completion_tokens", 8)
    return client.chat.completions.create(**kwargs)


def test_greedy_streamed_equals_whole(openai_client):
    whole = chat(openai_client, temperature=0)
    chunks = list(chat(openai_client, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"


def test_usage_matches_the_chat_template(openai_client, real_server):
    result = chat(openai_client, temperature=0, extra_body={"ignore_eos": True})
    counted = httpx.post(f"{real_server.url}/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert result.usage.prompt_tokens == counted
    assert result.usage.completion_tokens == 8 and result.choices[0].finish_reason == "length"


def test_max_tokens_is_honoured_too(openai_client):
    result = chat(openai_client, max_completion_tokens=None, max_tokens=3, temperature=0,
                  extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 3


def test_n_and_logprobs(openai_client):
    result = chat(openai_client, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=3, max_completion_tokens=4)
    assert [choice.index for choice in result.choices] == [0, 1]
    for choice in result.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 4
        assert "".join(entry.token for entry in content).startswith(choice.message.content[:1])
        assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)


def test_stream_with_usage_and_stop(openai_client):
    chunks = list(chat(openai_client, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    if len(text) > 2:  # stop at the text's second character: the reply is cut right before it
        stopped = chat(openai_client, temperature=0, stop=[text[1:3]])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == text[: text.index(text[1:3])]


def test_json_schema_response_format(openai_client):
    schema = {"type": "object", "properties": {"planet": {"type": "string"}, "moons": {"type": "integer"}},
              "required": ["planet", "moons"], "additionalProperties": False}
    reply = chat(openai_client, temperature=0, max_completion_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "planet", "schema": schema, "strict": True}})
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"planet", "moons"} and isinstance(answer["moons"], int)
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_choice_and_an_invalid_regex(openai_client):
    chunks = list(chat(openai_client, temperature=0, stream=True, extra_body={"guided_choice": ["Mars", "Venus"]}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("Mars", "Venus")
    with pytest.raises(openai.BadRequestError, match="structured_outputs is invalid") as caught:
        chat(openai_client, extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert caught.value.body["param"] == "structured_outputs"
