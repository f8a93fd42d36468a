"""Fuzzing the HTTP API: whatever a client sends, the answer is a 2xx or a 4xx with an OpenAI error body, never a
5xx, and the server keeps serving. The hypothesis runs go against the fake engine (fast); a fixed set of bodies
that only the real engine's own validation can judge goes against the real server.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.fuzz_strategies import POST_PATHS, ROUTE_BODIES, raw_bodies
from tests.server.helpers import API_KEY, REAL_MODEL, metric_value, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 64 * 1024
# Bounded in examples, and so in time: each example is one request of a few milliseconds.
# No example database: nothing is written into the checkout.
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_server(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0, total_blocks=64)
    engine = AsyncEngine(fake, max_waiting_requests=1024)
    app = build_app(engine, served_model_names=["fake"], api_key=API_KEY, max_body_bytes=BODY_LIMIT)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        yield client, fake, engine


def assert_error_body(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def assert_answered_sanely(response) -> None:
    """A 4xx with an error body, or a 2xx whose body parses; a stream never ends in a server error."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:1000]}"
    if response.status_code >= 400:
        assert_error_body(response)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]", events[-3:]
        for event in map(json.loads, events[:-1]):
            assert event.get("error", {}).get("type") != "server_error", event
    elif response.content:
        response.json()


def post_body(client, path: str, content: bytes):
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_answered_sanely(response)
    return response


@FUZZ
@given(route_and_body=st.sampled_from(ROUTE_BODIES).flatmap(lambda rb: st.tuples(st.just(rb[0]), rb[1])))
def test_fuzzed_request_fields_never_fail_the_server(fuzz_server, route_and_body):
    client = fuzz_server[0]
    path, body = route_and_body
    response = post_body(client, path, json.dumps(body).encode())
    event(f"{path} answered {response.status_code}")  # --hypothesis-show-statistics: how deep the fuzz reaches
    assert client.get("/health").status_code == 200


@FUZZ
@given(path=st.sampled_from(POST_PATHS), content=raw_bodies)
def test_fuzzed_raw_bodies_never_fail_the_server(fuzz_server, path, content):
    client = fuzz_server[0]
    event(f"{path} answered {post_body(client, path, content).status_code}")
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("content, fragment", [
    (b"[" * 30_000 + b"]" * 30_000, "too deeply"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "JSON"),
    (b'{"prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'\xff\xfe{"prompt": "x"}', "not valid JSON"),
])
def test_malformed_json_is_400(fuzz_server, content, fragment):
    response = post_body(fuzz_server[0], "/v1/completions", content)
    assert response.status_code == 400 and fragment in assert_error_body(response)["message"]


def test_oversized_bodies_are_413_declared_or_chunked(fuzz_server):
    client = fuzz_server[0]
    big = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    declared = client.post("/v1/completions", content=big)
    chunked = client.post("/v1/completions", content=iter([big[:1000], big[1000:]]))  # no Content-Length
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        error = assert_error_body(response)
        assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]
    assert client.get("/health").status_code == 200


def test_capacity_and_vocabulary_limits_are_400(fuzz_server):
    client = fuzz_server[0]
    for body in ({"prompt": "x", "n": 10**9}, {"prompt": "x " * 60, "n": 40},
                 {"prompt": [49152]}, {"prompt": "x", "logprobs": 21}):
        assert post_body(client, "/v1/completions", json.dumps(body).encode()).status_code == 400, body


def test_server_still_serves_and_holds_no_blocks_after_fuzzing(fuzz_server):
    client, fake, engine = fuzz_server
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " one two three"
    assert not fake.has_unfinished_requests() and engine.num_in_flight == 0
    assert engine.stats()["free_blocks"] == fake.total_blocks


# --- the real engine's own validation -------------------------------------------------------------------------
# The real server: max_model_len 512, 255 KV blocks of 16 tokens (4080 tokens), vocabulary 49152.
REAL_BAD_BODIES = [
    ("/v1/completions", {"prompt": [49152, 1]}, "vocabulary"),
    ("/v1/completions", {"prompt": [-1]}, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": [1] * 400, "n": 11}, "KV cache"),  # 11 x (400 + 1): even their starts
    ("/v1/completions", {"prompt": "x", "n": 10**9}, "KV cache"),
    ("/v1/completions", {"prompt": [1] * 600}, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**12]}, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"49152": 1}}, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "top_k": 10**30}, "top_k"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [49152]}, "allowed_token_ids has token id 49152"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids is empty"),
    ("/v1/completions", {"prompt": "x", "bad_words": [f"w{i}" for i in range(200)]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["no"], "use_beam_search": True, "n": 2}, "bad_words"),
]


@pytest.mark.parametrize("path, body, fragment", REAL_BAD_BODIES)
def test_real_engine_refuses_what_it_cannot_serve_with_400(real_server, path, body, fragment):
    response = httpx.post(real_server.url + path, json={"model": REAL_MODEL, **body}, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert fragment in assert_error_body(response)["message"]


@pytest.mark.parametrize("field, ids", [("stop_token_ids", [49152]), ("logit_bias", {"49152": 1}),
                                        ("allowed_token_ids", [3, 49152])])
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(real_server, field, ids):
    """Only the engine knows the vocabulary, so these fields are checked there; the error body still names them."""
    response = httpx.post(real_server.url + "/v1/completions", json={"model": REAL_MODEL, "prompt": "x", field: ids},
                          headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    error = assert_error_body(response)
    assert (error["param"], error["code"]) == (field, "invalid_value") and "49152" in error["message"]


# Values that pass validation but reach the jitted step: extreme, they must still give an answer, not kill it.
REAL_EXTREME_PARAMS = [{"temperature": 1e300}, {"temperature": 2e-5}, {"repetition_penalty": 1e300},
                       {"repetition_penalty": 1e-300}, {"top_p": 1e-300}, {"min_p": 1.0}, {"top_k": 2**31 - 1},
                       {"seed": -(2**63)}, {"seed": 10**30}, {"priority": -(10**30)},
                       {"presence_penalty": 2, "frequency_penalty": -2}, {"logit_bias": {"5": 1e9}},
                       {"allowed_token_ids": [0]}, {"bad_words": ["a" * 5000]}]


def test_real_engine_survives_extreme_sampling_values(real_server):
    with httpx.Client(base_url=real_server.url, headers=AUTH, timeout=120) as client:
        for params in REAL_EXTREME_PARAMS:
            body = {"model": REAL_MODEL, "prompt": "Hello", "max_tokens": 3, **params}
            response = client.post("/v1/completions", json=body)
            assert response.status_code in (200, 400), (params, response.text)
            assert client.get("/health").status_code == 200, params
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    total = metric_value(real_server.url, "jaxserve:kv_cache_total_blocks")
    assert metric_value(real_server.url, "jaxserve:kv_cache_free_blocks") == total
