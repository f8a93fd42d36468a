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
import threading
from collections.abc import Callable

from jaxserve.async_engine.beam_search_stream import BeamSearchStream
from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.config import MeshShape
from jaxserve.errors import QueueFull
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

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
        """`start(replica)` on the healthy replicas from the least loaded on, until one takes it: a full queue
        passes it on to the next (whose waiting requests may be fewer though more are in flight), and when every
        healthy one is full that is the answer (a 503 to retry). Only with no healthy replica are the others tried
        (all hung in a long step, or each refusing as it is: shutting down, dead). Any refusal but a full queue is
        final."""
        if any(replica.uses_request_id(request_id) for replica in self.replicas):
            raise ValueError(f"request id {request_id!r} is already in use")
        by_load = self._by_load()
        healthy = [replica for replica in by_load if replica.is_healthy]
        full = None
        for replica in healthy or by_load:
            try:
                return await start(replica)
            except QueueFull as exc:
                full = exc
        raise full

    def _by_load(self) -> list[AsyncEngine]:
        """The replicas from the fewest requests in flight, ties taking turns."""
        turn, n = next(self._ties), len(self.replicas)
        loads = [replica.num_in_flight for replica in self.replicas]
        return [self.replicas[i] for i in sorted(range(n), key=lambda i: (loads[i], (i - turn) % n))]

    # --- adapters and shutdown: every replica ------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False) -> LoRARequest:
        """Load the adapter on every replica, or on none: where one refuses it, the others unload it again (a new
        adapter; one replaced in place cannot be put back)."""
        loaded = await asyncio.gather(*(replica.add_lora(lora_request, load_inplace) for replica in self.replicas),
                                      return_exceptions=True)
        errors = [result for result in loaded if isinstance(result, BaseException)]
        if errors and not load_inplace:
            for replica, result in zip(self.replicas, loaded):
                if not isinstance(result, BaseException):
                    replica.remove_lora(lora_request.lora_name)
        raise_first(errors)
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


def build_replicas(make_engine: Callable, mesh: str | None, replicas: int, seed: int, warmup: bool) -> list:
    """`replicas` Engines of mesh `mesh`, each on its own run of devices: `make_engine(devices, **overrides)` builds
    one unwarmed, with `overrides` (Engine keywords) laid over its options. Replica `rank` is seeded `seed + rank`,
    so that unseeded requests sample differently on each, as they would one after another on one engine. They load
    in turn; the first sizes the KV cache and the others take its size, so every replica admits the same requests
    (max_model_len follows the cache) and none profiles again (on CPU, where they share host memory, each holds one
    engine's share). Then each compiles its step programs, side by side. ValueError if the devices are too few."""
    from jaxserve.parallel.sharding import replica_device_groups  # imports jax

    engines = []
    for rank, devices in enumerate(replica_device_groups(*MeshShape.of(mesh), replicas)):
        log.info("data-parallel replica %d of %d on %s", rank + 1, replicas, ", ".join(map(str, devices)))
        same_cache = {"num_kv_blocks": engines[0].config.cache.num_blocks} if engines else {}
        engines.append(make_engine(devices, seed=seed + rank, **same_cache))
    if warmup:
        _, errors = run_side_by_side(
            [lambda rank=rank: engines[rank].warmup(f"Compiling replica {rank + 1}'s step buckets")
             for rank in range(len(engines))], "jaxserve-warmup")
        raise_first(errors)
    return engines


def run_side_by_side(tasks: list[Callable], name: str) -> tuple[list, list[BaseException | None]]:
    """Run each task in a thread of its own and wait for all: (their results, their errors). The threads are
    daemons and the wait is interruptible, so a Ctrl-C (a KeyboardInterrupt here) ends the process at once instead
    of after every task, a compile or a device step that may take minutes, has finished."""
    results: list = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def run(index: int) -> None:
        try:
            results[index] = tasks[index]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which decides what to raise
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.2)
    return results, errors


def raise_first(errors: list[BaseException | None]) -> None:
    first = next((error for error in errors if error is not None), None)
    if first is not None:
        raise first
