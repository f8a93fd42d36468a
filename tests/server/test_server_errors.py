"""Acceptance: every error case of the real server returns its status and an OpenAI error body."""

import json

import httpx
import pytest

from tests.server.helpers import API_KEY, REAL_MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(server, path, body, headers=AUTH):
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", "{\"prompt\": ", "not valid JSON"),
    ("/v1/completions", {"model": REAL_MODEL}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt must be"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": [10 ** 8]}, "vocabulary"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n must be >= 1"),
])
def test_validation_errors_are_400_never_422(real_server, path, body, fragment):
    error = error_of(post(real_server, path, body), 400)
    assert error["type"] == "invalid_request_error" and fragment in error["message"]


def test_max_tokens_beyond_the_room_left_is_cut_to_it_and_beyond_any_context_refused(real_server):
    """As vLLM: a prompt and max_tokens that together pass the context generate up to its end; a max_tokens no
    context holds is refused, naming the numbers."""
    body = {"prompt": [1] * 508, "max_tokens": 100, "ignore_eos": True}
    reply = post(real_server, "/v1/completions", body).json()
    assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["finish_reason"] == "length"
    error = error_of(post(real_server, "/v1/completions", {"prompt": "word", "max_tokens": 600}), 400)
    assert "max_tokens=600" in error["message"] and "512" in error["message"] and error["param"] == "max_tokens"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600}
    assert "512" in error_of(post(real_server, "/v1/chat/completions", chat), 400)["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}])
def test_missing_or_wrong_api_key_is_401(real_server, headers):
    error = error_of(post(real_server, "/v1/completions", {"prompt": "x"}, headers=headers), 401)
    assert error["code"] == "invalid_api_key"
    assert error_of(httpx.get(f"{real_server.url}/v1/models", headers=headers), 401)


def test_unknown_model_is_404(real_server):
    error = error_of(post(real_server, "/v1/chat/completions",
                          {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}), 404)
    assert "gpt-4o" in error["message"] and error["param"] == "model"
    assert error_of(httpx.get(f"{real_server.url}/v1/nothing-here", headers=AUTH), 404)


