"""Prometheus metrics (prometheus_client, in a registry of our own), named as vLLM names them: `jaxserve:NAME`, or
with `serve --vllm-metric-names` `vllm:NAME`, so dashboards and autoscalers written for vLLM read them unchanged.

Latencies and token counts are observed as outputs reach the server; engine gauges (running and waiting
requests, KV cache usage, preemptions) are read from `AsyncEngine.stats()` at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import PoolingRequestOutput, RequestOutput

PREFIX, VLLM_PREFIX = "jaxserve:", "vllm:"
# Seconds: vLLM's buckets for each histogram (vllm/v1/metrics/buckets.py), so dashboards built on its `le` values
# read ours, and a batch request of an hour still lands in a bucket.
E2E_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                       240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
# vLLM's finish reasons: each series exists from the start, so rate() sees a reason's first request
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class EngineStatsCollector:
    """Turns the engine's counters into gauges and counters on every scrape."""

    def __init__(self, async_engine, model_name: str, prefix: str = PREFIX):
        self.async_engine = async_engine
        self.model_name = model_name
        self.prefix = prefix

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self.prefix + name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(self.prefix + name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _lora_info(self, stats: dict) -> GaugeMetricFamily:
        """vLLM's vllm:lora_requests_info: the adapters in use as labels (names joined by commas), the time of the
        reading as the value; dashboards show the series with the latest value."""
        family = GaugeMetricFamily(self.prefix + "lora_requests_info",
                                   "LoRA adapters of running and waiting requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(stats["max_loras"]), ",".join(stats["waiting_lora_adapters"]),
                           ",".join(stats["running_lora_adapters"])], time.time())
        return family

    def collect(self):
        stats = self.async_engine.stats()
        total, free = stats.get("total_blocks", 0), stats.get("free_blocks", 0)
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.get("num_waiting", 0))
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                          (total - free) / total if total else 0.0)
        yield self._gauge("kv_cache_total_blocks", "KV cache blocks available to requests.", total)
        yield self._gauge("kv_cache_free_blocks", "KV cache blocks not held by any request.", free)
        yield self._gauge("engine_healthy", "1 while the engine loop runs, 0 after it failed.",
                          1.0 if self.async_engine.is_healthy else 0.0)
        yield self._counter("num_preemptions", "Requests preempted for lack of KV blocks.",
                            stats.get("num_preemptions", 0))
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.get("prefix_cache_queries", 0))
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.get("prefix_cache_hits", 0))
        # Speculative decoding (vLLM's names): accepted / draft tokens is the acceptance rate, accepted / drafts
        # the tokens each drafting step gained.
        yield self._counter("spec_decode_num_drafts", "Steps in which a sequence fed draft tokens.",
                            stats.get("spec_decode_num_drafts", 0))
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                            stats.get("spec_decode_num_draft_tokens", 0))
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            stats.get("spec_decode_num_accepted_tokens", 0))
        if "max_loras" in stats:
            yield self._lora_info(stats)
        per_position = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                           "Drafts whose token at this position was accepted.",
                                           labels=["model_name", "position"])
        for position, accepted in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_position.add_metric([self.model_name, str(position)], accepted)
        yield per_position


class ServerMetrics:
    def __init__(self, async_engine, model_name: str, prefix: str = PREFIX):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter(prefix + "generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)
        self.request_success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(prefix + "time_to_first_token_seconds", "Time to first token.",
                                             labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(prefix + "inter_token_latency_seconds",
                                             "Time between successive outputs of a request.", labels,
                                             buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(prefix + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                                     buckets=E2E_LATENCY_BUCKETS, registry=self.registry)
        for metric in (self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                       self.inter_token_latency, self.e2e_latency):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.prompt_tokens_computed = 0  # not exported: the stats log line's prompt throughput
        self.registry.register(EngineStatsCollector(async_engine, model_name, prefix))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tokens_counted(self) -> tuple[float, float]:
        """(prompt tokens computed, generated tokens) so far: the prompt tokens the prefix cache did not serve
        (what vLLM's log line calls prompt throughput), and the generation counter's total."""
        [family] = self.generation_tokens.collect()
        return self.prompt_tokens_computed, sum(s.value for s in family.samples if s.name.endswith("_total"))

    async def observe(self, outputs: AsyncIterator[RequestOutput], arrival_time: float
                      ) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, recording token counts and latencies of this request (a pooling request, an
        embedding or a classification, generates no tokens and finishes as "stop")."""
        label = self.model_name
        tokens_seen = 0
        last_time = None
        finished = False
        try:
            async for output in outputs:
                now = time.monotonic()
                pooled = isinstance(output, PoolingRequestOutput)
                tokens = 0 if pooled else sum(len(completion.token_ids) for completion in output.outputs)
                if last_time is None:
                    self.prompt_tokens.labels(label).inc(len(output.prompt_token_ids))
                    self.prompt_tokens_computed += len(output.prompt_token_ids) - output.num_cached_tokens
                    self.time_to_first_token.labels(label).observe(now - arrival_time)
                elif tokens > tokens_seen:
                    self.inter_token_latency.labels(label).observe(now - last_time)
                self.generation_tokens.labels(label).inc(tokens - tokens_seen)
                tokens_seen, last_time = tokens, now
                if output.finished:
                    finished = True
                    # One finished request per sample, with its own reason, as vLLM counts an n > 1 request's
                    # child requests
                    reasons = ["stop"] if pooled else [c.finish_reason or "abort" for c in output.outputs] or ["abort"]
                    for reason in reasons:
                        self.e2e_latency.labels(label).observe(now - arrival_time)
                        self.request_success.labels(label, reason).inc()
                yield output
        finally:
            # The client left, the server ended it (a request timeout) or the engine failed: counted as an abort
            # (vLLM counts a client's abort nowhere; here a dashboard sees how many clients gave up)
            if not finished:
                self.request_success.labels(label, "abort").inc()
