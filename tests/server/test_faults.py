"""Timeouts, failing steps and overload, over the fake engine: every request gets an answer, nothing hangs, no KV
block is left held."""

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import serve_in_thread


@pytest.fixture
def serve(tokenizer):
    """serve(fake=None, **AsyncEngine options) -> (url, fake engine, AsyncEngine); stopped after the test."""
    with contextlib.ExitStack() as servers:
        def start(fake=None, **options):
            fake = fake or FakeEngine(tokenizer, step_delay=0.02)
            engine = AsyncEngine(fake, **options)
            return servers.enter_context(serve_in_thread(build_app(engine))), fake, engine

        yield start


def error_of(response, status) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def wait_until(condition, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def sse_events(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# --- per-request timeout ----------------------------------------------------------------------------------------
def test_request_timeout_aborts_the_request_frees_its_blocks_and_answers_504(serve):
    url, fake, engine = serve(request_timeout=0.3)
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 200}, timeout=10)
    error = error_of(response, 504)
    assert error["code"] == "request_timeout" and "0.3 s" in error["message"]
    assert time.monotonic() - started < 2  # 200 tokens would take 4 s
    assert wait_until(lambda: engine.stats()["free_blocks"] == fake.total_blocks and engine.num_in_flight == 0)
    assert fake.aborted and not fake.has_unfinished_requests()
    # A timeout is the request's failure, not the server's.
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200


def test_openai_sdk_does_not_retry_a_timed_out_request(serve):
    """The SDK retries 5xx answers twice by default; a timed-out request would time out again each time."""
    import openai

    url, fake, engine = serve(request_timeout=0.2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, timeout=10)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model="fake-model", prompt="Hello", max_tokens=200)
    assert raised.value.status_code == 504 and raised.value.response.headers["x-should-retry"] == "false"
    assert len(fake.aborted) == 1  # one attempt: each attempt that times out is aborted


def test_request_timeout_mid_stream_ends_with_an_error_event(serve):
    url, fake, engine = serve(request_timeout=0.3)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as response:
        events = sse_events(response)
    assert len(events) > 3 and events[-1]["error"]["code"] == "request_timeout"
    assert wait_until(lambda: engine.stats()["free_blocks"] == fake.total_blocks and engine.num_in_flight == 0)


def test_request_timeout_mid_stream_fails_a_response_with_response_failed(serve):
    url, fake, engine = serve(request_timeout=0.3)
    body = {"input": "Hi", "max_output_tokens": 200, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=10) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert len(events) > 5 and [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "request_timeout"
    assert failed["sequence_number"] == len(events) - 1
    assert wait_until(lambda: engine.stats()["free_blocks"] == fake.total_blocks and engine.num_in_flight == 0)
    # Stored (OpenAI's default), as OpenAI keeps a failed response: GET answers with the failure.
    kept = httpx.get(f"{url}/v1/responses/{failed['response']['id']}").json()
    assert kept["status"] == "failed" and kept["error"]["code"] == "request_timeout"
    [message] = kept["output"]
    assert kept["output"] == failed["response"]["output"] and message["status"] == "incomplete"
    streamed = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert streamed and message["content"][0]["text"] == streamed
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"] == message


# --- a failing step ---------------------------------------------------------------------------------------------
def test_failing_step_fails_every_request_in_flight_with_500_logs_why_and_turns_health_503(serve, caplog):
    url, fake, engine = serve()

    async def three_requests_then_a_fault():
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            posts = [asyncio.create_task(client.post("/v1/completions", json={"prompt": f"{i}", "max_tokens": 200}))
                     for i in range(3)]
            await asyncio.to_thread(wait_until, lambda: engine.stats()["num_running"] == 3)
            fake.fail_next_step = True
            return await asyncio.gather(*posts)

    for response in asyncio.run(three_requests_then_a_fault()):
        error = error_of(response, 500)
        assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
    assert "engine step failed" in caplog.text and "RuntimeError: simulated device failure" in caplog.text
    started = time.monotonic()
    error = error_of(httpx.get(url + "/health", timeout=2), 503)
    assert error["code"] == "engine_dead"
    later = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=2)
    assert error_of(later, 500)["code"] == "engine_dead"
    assert time.monotonic() - started < 2  # answered at once, nothing waits on the dead engine
    assert engine.num_in_flight == 0


class FailingAddEngine(FakeEngine):
    """Refuses one request in the loop thread, as a device-side allocation failure might."""

    def add_prepared_request(self, request):
        if request.prompt == "poison":
            raise RuntimeError("cannot place this request")
        super().add_prepared_request(request)


def test_a_request_refused_inside_the_loop_fails_alone(serve, tokenizer):
    url, fake, engine = serve(FailingAddEngine(tokenizer))
    error = error_of(httpx.post(url + "/v1/completions", json={"prompt": "poison"}), 500)
    assert "cannot place this request" in error["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200


class StuckEngine(FakeEngine):
    """A step that blocks (a hung device) until released."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.release = threading.Event()

    def step(self):
        self.step_started.set()
        self.release.wait(10)
        return super().step()


@contextlib.contextmanager
def one_stuck_request(url, fake):
    """A completion whose first step blocks until the block ends; yields the list its response lands in."""
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=15)))
    waiting.start()
    try:
        assert fake.step_started.wait(5)
        yield answers
    finally:
        fake.release.set()
        waiting.join(10)


def test_health_and_metrics_answer_while_a_step_is_stuck(serve, tokenizer):
    url, fake, engine = serve(StuckEngine(tokenizer))
    with one_stuck_request(url, fake) as answers, httpx.Client(base_url=url, timeout=2) as client:
        started = time.monotonic()
        assert client.get("/health").status_code == 200
        assert "jaxserve:num_requests_running" in client.get("/metrics").text
        assert time.monotonic() - started < 1
    assert answers[0].status_code == 200


def test_a_step_past_the_step_timeout_turns_health_503_until_it_returns(serve, tokenizer, caplog):
    """A hung device neither fails nor returns: /health must say so (a load balancer then routes elsewhere),
    and recover once the step does return."""
    url, fake, engine = serve(StuckEngine(tokenizer), step_timeout=0.3)
    with one_stuck_request(url, fake) as answers, httpx.Client(base_url=url, timeout=2) as client:
        assert wait_until(lambda: client.get("/health").status_code == 503)
        error = error_of(client.get("/health"), 503)
        assert error["code"] == "engine_hung" and "0.3 s (--step-timeout)" in error["message"]
        assert wait_until(lambda: any("has been running" in r.message for r in caplog.records))  # the watchdog
    assert answers[0].status_code == 200
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 200)
    assert sum("has been running for over 0.3 s" in r.message for r in caplog.records) == 1  # while hung
    assert any("over --step-timeout (0.3 s)" in r.message for r in caplog.records)  # once it returned


def test_a_client_leaving_before_its_body_is_sent_is_no_error(serve, caplog):
    url, fake, engine = serve()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    time.sleep(0.3)
    assert "Traceback" not in caplog.text and not caplog.records
    assert httpx.get(url + "/health").status_code == 200


# --- overload ---------------------------------------------------------------------------------------------------
def test_burst_beyond_the_queue_gets_503_and_every_admitted_request_completes(serve):
    url, fake, engine = serve(max_waiting_requests=4)

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(30)))

    responses = asyncio.run(burst())
    statuses = [response.status_code for response in responses]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 4
    for response in responses:
        if response.status_code == 503:
            assert error_of(response, 503)["code"] == "queue_full" and response.headers["retry-after"] == "1"
        else:  # admitted: answered in full
            choice = response.json()["choices"][0]
            assert choice["text"] == " one two three four five" and choice["finish_reason"] == "length"
    assert wait_until(lambda: engine.stats()["free_blocks"] == fake.total_blocks and engine.num_in_flight == 0)
    assert httpx.get(url + "/health").status_code == 200
