"""The periodic engine line vLLM's users watch in their logs (off with `--disable-log-stats`):

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 12 reqs,
    Waiting: 0 reqs, KV cache usage: 23.4%, Prefix cache hit rate: 41.0%

Throughputs and the hit rate cover the interval since the last line; token counts are those the server's metrics
counted (server/metrics.py), the rest is read from `AsyncEngine.stats()`. An idle server logs nothing: a line is
written while there is work, and once more after it ends, so the last line shows the server went idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass

from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger("jaxserve.stats")

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    """Seconds between lines: JAXSERVE_LOG_STATS_INTERVAL (as vLLM's VLLM_LOG_STATS_INTERVAL), else 10."""
    text = os.environ.get("JAXSERVE_LOG_STATS_INTERVAL")
    if not text:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):  # 0 or less would spin on the event loop
        logger.warning("JAXSERVE_LOG_STATS_INTERVAL=%r is not a positive number of seconds; logging stats every "
                       "%g s", text, DEFAULT_LOG_STATS_INTERVAL_S)
        return DEFAULT_LOG_STATS_INTERVAL_S
    return seconds


@dataclass
class _Totals:
    at: float
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0


class StatsLogger:
    def __init__(self, metrics: ServerMetrics, async_engine, interval: float):
        self.metrics, self.async_engine, self.interval = metrics, async_engine, interval
        self._last = self._totals(time.monotonic(), {})
        self._was_busy = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line(time.monotonic())
            if line is not None:
                logger.info(line)

    def line(self, now: float) -> str | None:
        """The line for the interval ending `now`, or None when it and the one before were idle."""
        stats = self.async_engine.stats()
        totals, last = self._totals(now, stats), self._last
        self._last = totals
        seconds = max(now - last.at, 1e-9)
        prompt_rate = (totals.prompt_tokens - last.prompt_tokens) / seconds
        generation_rate = (totals.generation_tokens - last.generation_tokens) / seconds
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        busy = bool(prompt_rate or generation_rate or running or waiting)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        queries = totals.prefix_queries - last.prefix_queries
        hit_rate = (totals.prefix_hits - last.prefix_hits) / queries if queries else 0.0
        total_blocks = stats.get("total_blocks") or 1
        usage = 1.0 - stats.get("free_blocks", total_blocks) / total_blocks
        return (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
                f"{generation_rate:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}")

    def _totals(self, now: float, stats: dict) -> _Totals:
        return _Totals(now, *self.metrics.tokens_counted(), stats.get("prefix_cache_queries", 0),
                       stats.get("prefix_cache_hits", 0))
