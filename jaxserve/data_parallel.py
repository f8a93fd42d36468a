"""Data parallelism (vLLM's --data-parallel-size): several replicas of the engine, each on its own tp x pp devices
with its own KV cache and scheduler, served as one.

`build_replicas` loads them (for `serve -dp N` and a batch job's `data_parallel_size`). In the server each
replica is an `AsyncEngine` with its own loop thread (jax releases the GIL while a device computes, so the
replicas' steps overlap); `DataParallelAsyncEngine` has the AsyncEngine surface the server uses: a request goes
to the healthy replica with the fewest requests in flight (the next one when its queue is full), and aborts,
adapters and shutdown reach every replica. Request ids are unique across replicas. Batch jobs run a runner per
replica instead (batch/replicas.py). Imports no jax.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from jaxserve.async_engine import AsyncEngine
from jaxserve.beam_search_params import BeamSearchParams
from jaxserve.beam_search_stream import BeamSearchStream
from jaxserve.lora_request import LoRARequest
from jaxserve.request_errors import QueueFull
from jaxserve.request_stream import RequestStream
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Stats every replica reports alike: taken from the first, not summed.
SAME_ON_EVERY_REPLICA = {"block_size", "max_loras"}


def _same_on_every_replica(name: str) -> property:
    """An AsyncEngine attribute every replica shares (the model, its tokenizer, the options): the first's."""
    return property(lambda self: getattr(self._first, name))


class DataParallelAsyncEngine:
    """Serve several AsyncEngines over disjoint devices as one; they must run the same model and options."""

    def __init__(self, replicas: list[AsyncEngine]):
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = replicas
        self._first = replicas[0]
        self._ties = itertools.count()  # equal loads take turns

    @classmethod
    def serving(cls, engines: list, *, max_waiting_requests: int, **options) -> DataParallelAsyncEngine:
        """Wrap each Engine in an AsyncEngine (`options` as AsyncEngine takes them), the waiting bound shared out
        so the server as a whole holds about `max_waiting_requests`."""
        share = math.ceil(max_waiting_requests / len(engines))
        return cls([AsyncEngine(engine, max_waiting_requests=share, **options) for engine in engines])

    # --- what the server may know: the same on every replica ---------------------------------------------------
    model_name = _same_on_every_replica("model_name")
    max_model_len = _same_on_every_replica("max_model_len")
    tokenizer = _same_on_every_replica("tokenizer")
    head = _same_on_every_replica("head")
    generation_defaults = _same_on_every_replica("generation_defaults")
    step_timeout = _same_on_every_replica("step_timeout")
    request_timeout = _same_on_every_replica("request_timeout")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]:
        return self._first.encode_chat(messages, add_generation_prompt, **rendering)

    # --- health: the server is as healthy as its least healthy replica -----------------------------------------
    @property
    def is_healthy(self) -> bool:
        return all(replica.is_healthy for replica in self.replicas)

    @property
    def is_hung(self) -> bool:
        return any(replica.is_hung for replica in self.replicas)

    @property
    def is_draining(self) -> bool:
        return any(replica.is_draining for replica in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    def stats(self) -> dict:
        """The replicas' counters added up (KV blocks, requests, tokens...); per-position lists added position
        by position, adapter names gathered."""
        return merge_stats([replica.stats() for replica in self.replicas])

    # --- requests ---------------------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str,
                          priority: int = 0, lora_request: LoRARequest | None = None,
                          continuing: bool = False) -> RequestStream:
        """Queue the request on the least loaded replica; raises as AsyncEngine.add_request does."""
        return await self._place(request_id, lambda replica: replica.add_request(
            prompt, params, request_id, priority=priority, lora_request=lora_request, continuing=continuing))

    generate = AsyncEngine.generate  # it needs only add_request: yields a request's outputs from this one's

    async def beam_search(self, prompt: str | list[int], params: BeamSearchParams, request_id: str,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> BeamSearchStream:
        """All of a search's rounds run on one replica, whose prefix cache holds the beams' shared prefix."""
        return await self._place(request_id, lambda replica: replica.beam_search(
            prompt, params, request_id, priority=priority, lora_request=lora_request))

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:  # an id a replica does not hold is nothing to it
            await replica.abort(request_id)

    async def _place(self, request_id: str, start):
        """`start(replica)` on the replicas from the least loaded on, until one takes it: a full queue passes it on
        to the next (whose waiting requests may be fewer though more are in flight). Any other refusal is final."""
        if any(replica.uses_request_id(request_id) for replica in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        full = None
        for replica in self._by_load():
            try:
                return await start(replica)
            except QueueFull as exc:
                full = exc
        raise full

    def _by_load(self) -> list[AsyncEngine]:
        """Healthy replicas first (a dead or hung one only when none is), then fewest in flight, ties in turn."""
        turn, n = next(self._ties), len(self.replicas)
        health = [replica.is_healthy for replica in self.replicas]
        loads = [replica.num_in_flight for replica in self.replicas]
        order = sorted(range(n), key=lambda i: (not health[i], loads[i], (i - turn) % n))
        return [self.replicas[i] for i in order]

    # --- adapters and shutdown: every replica ------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False) -> LoRARequest:
        loaded = await asyncio.gather(*(replica.add_lora(lora_request, load_inplace) for replica in self.replicas))
        return loaded[0]

    def remove_lora(self, lora_name: str) -> None:
        for replica in self.replicas:
            replica.remove_lora(lora_name)

    def stop_admitting(self) -> None:
        for replica in self.replicas:
            replica.stop_admitting()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self.stop()  # all at once, then wait for each
        for replica in self.replicas:
            replica.shutdown(timeout)


def merge_stats(parts: list[dict]) -> dict:
    """One replica's stats form from several: numbers summed (KV blocks too, so usage is the whole cache's),
    lists of counts summed position by position, lists of names gathered."""
    merged = {}
    for key, first in parts[0].items():
        values = [part[key] for part in parts if key in part]
        if key in SAME_ON_EVERY_REPLICA or isinstance(first, (str, bool)) or first is None:
            merged[key] = first
        elif isinstance(first, list) and all(isinstance(v, str) for value in values for v in value):
            merged[key] = sorted(set().union(*values))
        elif isinstance(first, list):
            merged[key] = [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
        else:
            merged[key] = sum(values)
    return merged


def build_replicas(make_engine: Callable, device_groups: list[list], warmup: bool) -> list:
    """One Engine per device group: `make_engine(devices, num_kv_blocks)` builds one unwarmed (num_kv_blocks None:
    as the options say). They load in turn; the first sizes the KV cache and the others take its size, so every
    replica admits the same requests (max_model_len follows the cache) and none profiles again (on CPU, where they
    share host memory, each holds one engine's share). Then each compiles its step programs, side by side."""
    engines, num_kv_blocks = [], None
    for rank, devices in enumerate(device_groups):
        log.info("data-parallel replica %d of %d on %s", rank + 1, len(device_groups), ", ".join(map(str, devices)))
        engines.append(make_engine(devices, num_kv_blocks))
        num_kv_blocks = engines[0].config.cache.num_blocks
    if warmup:
        with ThreadPoolExecutor(len(engines), thread_name_prefix="jaxserve-warmup") as pool:
            list(pool.map(lambda rank: engines[rank].warmup(f"Compiling replica {rank + 1}'s step buckets"),
                          range(len(engines))))
    return engines
