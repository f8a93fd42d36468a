"""Graceful shutdown of `jaxserve serve` (the fake engine behind the real CLI path): SIGTERM stops admitting,
lets requests in flight finish within the grace period, aborts the rest with an error event, and exits 0."""

import contextlib
import json
import signal
import time

import httpx

from tests.server.fake_serve import fake_server_process

STEP_SECONDS = 0.02  # per generated token
GRACE_SECONDS = 4.0


def open_stream(stack: contextlib.ExitStack, url: str, max_tokens: int):
    """A streaming completion, read up to its first event; returns the iterator over its remaining lines."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "stream": True}
    response = stack.enter_context(httpx.stream("POST", url + "/v1/completions", json=body, timeout=30))
    assert response.status_code == 200
    lines = (line for line in response.iter_lines() if line)
    assert next(lines).startswith("data: {")
    return lines


def events_of(lines) -> tuple[list[dict], str]:
    lines = list(lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]], lines[-1]


def test_sigterm_drains_in_flight_requests_refuses_new_ones_then_aborts_the_rest_and_exits_0(tokenizer_dir,
                                                                                             tmp_path):
    args = ["--shutdown-grace-seconds", str(GRACE_SECONDS)]
    with fake_server_process(tokenizer_dir, args, tmp_path / "serve.log", STEP_SECONDS) as server, \
            contextlib.ExitStack() as streams:
        short = open_stream(streams, server.url, max_tokens=50)  # ~1 s: finishes within the grace period
        long = open_stream(streams, server.url, max_tokens=250)  # ~5 s: outlives it
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)

        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "late"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"

        events, last = events_of(short)
        assert last == "data: [DONE]" and all("error" not in event for event in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        events, last = events_of(long)
        aborted_after = time.monotonic() - signalled
        assert last == "data: [DONE]" and events[-1]["error"]["code"] == "shutting_down"
        assert GRACE_SECONDS - 0.5 < aborted_after < GRACE_SECONDS + 3

        assert server.process.wait(15) == 0
    log = server.log()
    assert "waiting up to 4 s for 2 in flight" in log and "1 requests still running 4 s after" in log


def test_sigterm_with_nothing_in_flight_exits_0_at_once(tokenizer_dir, tmp_path):
    with fake_server_process(tokenizer_dir, [], tmp_path / "serve.log", STEP_SECONDS) as server:
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert server.process.wait(15) == 0
        assert time.monotonic() - started < 3
