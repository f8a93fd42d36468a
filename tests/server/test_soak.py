"""Soak: a bounded run of mixed streaming and whole requests against the real engine, a good share of whose clients
walk away mid-answer (or before sending their body), ends with every KV block free and the server healthy."""

import asyncio
import json
import random
import time
from collections import Counter

import httpx

from tests.server.helpers import API_KEY, REAL_MODEL, metric_value

SOAK_SECONDS = 10
CLIENTS = 6
MARKER = "zebra-soak-7731"  # in every prompt: it must not reach the server log
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FINISH_REASONS = {"stop", "length"}


def completion(rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, dict]:
    body = {"model": REAL_MODEL, "max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1000)}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"{MARKER}: tell a story"}]}
    prompts = f"{MARKER} once upon a time" if rng.random() < 0.7 else [f"{MARKER} one", f"{MARKER} two"]
    return "/v1/completions", {**body, "prompt": prompts, "n": rng.choice([1, 1, 2])}


async def stream_to_the_end(client, rng) -> str:
    path, body = completion(rng, stream=True, max_tokens=rng.randint(2, 16))
    reasons = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                reasons += [choice["finish_reason"] for choice in event["choices"] if choice["finish_reason"]]
    assert reasons and set(reasons) <= FINISH_REASONS, reasons
    return "streamed"


async def stream_then_leave(client, rng) -> str:
    path, body = completion(rng, stream=True, max_tokens=200)
    leave_after = rng.randint(1, 4)
    async with client.stream("POST", path, json={**body, "ignore_eos": True}) as response:
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if events >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return "left mid-stream"


async def whole_answer(client, rng) -> str:
    path, body = completion(rng, stream=False, max_tokens=rng.randint(2, 12))
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert {choice["finish_reason"] for choice in response.json()["choices"]} <= FINISH_REASONS
    return "whole"


async def wait_then_leave(client, rng) -> str:
    path, body = completion(rng, stream=False, max_tokens=200)
    try:
        await asyncio.wait_for(client.post(path, json={**body, "ignore_eos": True}), rng.uniform(0.05, 1.0))
    except asyncio.TimeoutError:
        return "left while waiting"
    return "whole"


async def leave_before_the_body(client, rng) -> str:
    """Headers promising a body, half of it, then gone."""
    _, writer = await asyncio.open_connection("127.0.0.1", int(client.base_url.port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    await writer.drain()
    writer.close()
    return "left before the body"


async def bad_request(client, rng) -> str:
    response = await client.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 2})
    assert response.status_code == 400
    return "refused"


KINDS = [stream_to_the_end, stream_then_leave, whole_answer, wait_then_leave, leave_before_the_body, bad_request]
WEIGHTS = [3, 3, 3, 3, 1, 1]


async def soak(url: str, seconds: float) -> Counter:
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds

    async def client_loop(index: int) -> None:
        rng = random.Random(index)
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
            while time.monotonic() < deadline:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                outcomes[await kind(client, rng)] += 1

    await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))
    return outcomes


def wait_for_idle(url: str, total: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric_value(url, "jaxserve:kv_cache_free_blocks") == total
                and metric_value(url, "jaxserve:num_requests_running") == 0
                and metric_value(url, "jaxserve:num_requests_waiting") == 0):
            return
        time.sleep(0.2)


def test_soak_with_disconnects_leaks_no_kv_blocks(real_server):
    url = real_server.url
    total = metric_value(url, "jaxserve:kv_cache_total_blocks")
    wait_for_idle(url, total)
    assert metric_value(url, "jaxserve:kv_cache_free_blocks") == total
    aborted_before = metric_value(url, "jaxserve:request_success_total", finished_reason="abort")
    log_before = len(real_server.log())

    outcomes = asyncio.run(soak(url, SOAK_SECONDS))
    print(f"soak outcomes over {SOAK_SECONDS} s: {dict(outcomes)}")
    assert outcomes["left mid-stream"] and outcomes["left while waiting"] and outcomes["streamed"]

    wait_for_idle(url, total)
    assert metric_value(url, "jaxserve:kv_cache_free_blocks") == total  # zero leaked blocks
    assert metric_value(url, "jaxserve:num_requests_running") == 0
    assert metric_value(url, "jaxserve:request_success_total", finished_reason="abort") > aborted_before
    assert httpx.get(url + "/health").status_code == 200
    after = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
    assert after.status_code == 200
    soak_log = real_server.log()[log_before:]
    assert "Traceback" not in soak_log  # a client leaving is routine, not an error
    assert MARKER not in real_server.log()  # prompts stay out of the log


def test_more_requests_than_sequences_and_kv_blocks_all_complete(real_server):
    """24 at once (the server runs at most 16 sequences), 16 of which together need more KV blocks than exist: the
    rest wait their turn, or are preempted and resumed, and every one finishes in full."""
    url = real_server.url
    total = metric_value(url, "jaxserve:kv_cache_total_blocks")
    preemptions_before = metric_value(url, "jaxserve:num_preemptions_total")

    async def one(client, index: int):
        if index < 16:  # 200 distinct prompt tokens (no shared prefix) + 60 = 17 blocks each; 16 x 17 > 255
            prompt, max_tokens = list(range(1000 + 300 * index, 1200 + 300 * index)), 60
        else:
            prompt, max_tokens = f"{MARKER} request {index}:", 4
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return max_tokens, response.json()["usage"]["completion_tokens"]

    async def burst():
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    for asked, generated in asyncio.run(burst()):
        assert generated == asked  # nothing admitted is dropped or cut short
    assert metric_value(url, "jaxserve:num_preemptions_total") > preemptions_before
    wait_for_idle(url, total)
    assert metric_value(url, "jaxserve:kv_cache_free_blocks") == total
