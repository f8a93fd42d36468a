"""Acceptance: concurrency, client disconnects freeing KV blocks, metrics, and the small endpoints."""

import asyncio
import time

import httpx
import openai

from tests.server.helpers import API_KEY, REAL_MODEL, metric_value

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_startup_log_names_model_mesh_kv_capacity_and_url(real_server):
    log = real_server.log()
    assert REAL_MODEL in log and "mesh 1x1" in log
    assert "KV cache: 255 blocks x 16 tokens = 4080 tokens" in log
    assert real_server.url in log


def test_small_endpoints(real_server):
    assert httpx.get(f"{real_server.url}/health").status_code == 200
    assert httpx.get(f"{real_server.url}/version").json()["version"]
    models = httpx.get(f"{real_server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == REAL_MODEL and models["data"][0]["max_model_len"] == 512
    ids = httpx.post(f"{real_server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{real_server.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "Hello world"}


def test_forty_concurrent_requests_all_complete(real_server):
    client = openai.AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(i):
        if i % 4 == 0:
            stream = await client.completions.create(model=REAL_MODEL, prompt=f"Fact number {i}:", max_tokens=8,
                                                     stream=True, seed=i)
            return [choice.finish_reason async for chunk in stream for choice in chunk.choices][-1]
        if i % 4 == 1:
            result = await client.chat.completions.create(
                model=REAL_MODEL, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=8, seed=i)
            return result.choices[0].finish_reason
        result = await client.completions.create(model=REAL_MODEL, prompt=f"{i} plus {i} is", max_tokens=8)
        return result.choices[0].finish_reason

    async def run_all():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(40)))

    reasons = asyncio.run(run_all())
    assert len(reasons) == 40 and set(reasons) <= {"stop", "length"}
    assert metric_value(real_server.url, "jaxserve:num_requests_running") == 0


def test_client_disconnect_mid_stream_frees_its_blocks(real_server):
    url = real_server.url
    total = metric_value(url, "jaxserve:kv_cache_total_blocks")
    assert metric_value(url, "jaxserve:kv_cache_free_blocks") == total
    aborted_before = metric_value(url, "jaxserve:request_success_total", finished_reason="abort")
    body = {"model": REAL_MODEL, "prompt": "Write a long story about a dragon." * 8, "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(3):  # a few tokens in: the request holds KV blocks now
            next(line for line in lines if line)
        assert metric_value(url, "jaxserve:kv_cache_free_blocks") < total
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric_value(url, "jaxserve:kv_cache_free_blocks") < total:
        time.sleep(0.1)
    assert metric_value(url, "jaxserve:kv_cache_free_blocks") == total
    assert metric_value(url, "jaxserve:request_success_total", finished_reason="abort") == aborted_before + 1
    assert metric_value(url, "jaxserve:num_requests_running") == 0


def test_metrics_record_tokens_and_latencies(real_server, openai_client):
    openai_client.completions.create(model=REAL_MODEL, prompt="Hello", max_tokens=4)
    url = real_server.url
    assert metric_value(url, "jaxserve:prompt_tokens_total") > 0
    assert metric_value(url, "jaxserve:generation_tokens_total") >= 4
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric_value(url, f"jaxserve:{histogram}_count") > 0
    assert 0 <= metric_value(url, "jaxserve:kv_cache_usage_perc") <= 1
    assert metric_value(url, "jaxserve:num_preemptions_total") >= 0
