"""The periodic engine stats line (server/stats_log.py): rates over the interval, quiet while idle, on in serve."""

import logging
import time

import httpx
import pytest

from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.server.app import build_app
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.stats_log import StatsLogger, log_stats_interval
from tests.server.fake_engine import FakeEngine
from tests.server.fake_serve import fake_server_process
from tests.server.helpers import serve_in_thread


class StubEngine:
    """An AsyncEngine's stats, set by the test."""

    def __init__(self):
        self.counters = {"total_blocks": 100, "free_blocks": 100, "num_running": 0, "num_waiting": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def stats(self):
        return dict(self.counters)


def finished_request(metrics, prompt_tokens: int, cached: int, generated: int) -> None:
    """Pass one finished request's output through `metrics.observe`, as the server does."""
    import asyncio

    from jaxserve.outputs import CompletionOutput, RequestOutput

    async def one():
        yield RequestOutput("r", None, list(range(prompt_tokens)), [CompletionOutput(0, "", [7] * generated, "length")],
                            finished=True, num_cached_tokens=cached)

    async def consume():
        async for _ in metrics.observe(one(), time.monotonic()):
            pass

    asyncio.run(consume())


def test_rates_cover_the_interval_and_an_idle_server_is_quiet():
    engine = StubEngine()
    metrics = ServerMetrics(engine, "m")
    stats = StatsLogger(metrics, engine, interval=10)
    start = stats._last.at
    assert stats.line(start + 10) is None  # idle, and idle before
    # prompt throughput counts the prompt tokens computed, not those the prefix cache served (vLLM's line)
    finished_request(metrics, prompt_tokens=1000, cached=500, generated=40)
    engine.counters.update(num_running=3, num_waiting=1, free_blocks=75, prefix_cache_queries=8, prefix_cache_hits=2)
    assert stats.line(start + 20) == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                                      "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                                      "Prefix cache hit rate: 25.0%")
    engine.counters.update(num_running=0, num_waiting=0, free_blocks=100)
    metrics.generation_tokens.labels("m").inc(10)
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0 tokens/s" in stats.line(start + 25)
    assert "Running: 0 reqs" in stats.line(start + 30)  # the work ended: one line says so
    assert stats.line(start + 40) is None


@pytest.mark.parametrize("value, seconds", [(None, 10.0), ("2.5", 2.5), ("0", 10.0), ("-1", 10.0), ("nan", 10.0),
                                            ("soon", 10.0)])
def test_the_interval_comes_from_the_environment_if_it_is_a_positive_number(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("JAXSERVE_LOG_STATS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("JAXSERVE_LOG_STATS_INTERVAL", value)
    assert log_stats_interval() == seconds


def test_the_app_logs_the_line_while_serving(tokenizer, caplog):
    app = build_app(AsyncEngine(FakeEngine(tokenizer, step_delay=0.02)), log_stats_interval=0.1)
    with caplog.at_level(logging.INFO, logger="jaxserve.stats"), serve_in_thread(app) as url:
        httpx.post(url + "/v1/completions", json={"prompt": "Count:", "max_tokens": 20}, timeout=30)
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxserve.stats"]
    assert any("Avg generation throughput" in line and not line.startswith("Avg prompt throughput: 0.0")
               for line in lines), lines


def serve_and_log(tokenizer_dir, log_path, flags):
    with fake_server_process(tokenizer_dir, flags, log_path) as server:
        httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 20}, timeout=30)
        time.sleep(0.5)
    return server.log()


def test_serve_logs_stats_unless_disabled_and_takes_vllm_logging_flags(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_LOG_STATS_INTERVAL", "0.1")
    log = serve_and_log(tokenizer_dir, tmp_path / "default.log", [])
    assert "Avg prompt throughput" in log and "POST /v1/completions" in log and "prompt 'Hi'" not in log
    quiet = ["--disable-log-stats", "--disable-log-requests", "--disable-uvicorn-access-log",
             "--uvicorn-log-level", "warning", "--enable-log-requests"]
    log = serve_and_log(tokenizer_dir, tmp_path / "quiet.log", quiet)
    assert "prompt 'Hi'" in log  # --enable-log-requests is --log-prompts
    assert "POST /v1/completions" not in log and "Avg prompt throughput" not in log
