"""AsyncEngine: the synchronous Engine stepped by one background thread, driven from asyncio.

Why a thread: `Engine.step()` blocks for the length of a device step, but jax releases the GIL while the device
computes, so the event loop keeps serving HTTP meanwhile. The two sides never share engine state:

  asyncio side                         loop thread (owns the Engine)
  add_request() --(commands queue)-->  add_prepared_request / abort_request, then step()
  RequestStream <--call_soon_threadsafe-- outputs of requests that progressed

Tokenisation and validation (`Engine.prepare_request`, thread-safe, no device work) happen on the caller's side
so that a bad request fails before anything is queued or streamed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from jaxserve.async_engine.admission import Admission
from jaxserve.async_engine.beam_search_stream import BeamSearchStream
from jaxserve.async_engine.request_stream import END_OF_STREAM, RequestStream
from jaxserve.async_engine.step_watch import DEFAULT_STEP_TIMEOUT_S, StepWatch
from jaxserve.engine.interface import StepEngine
from jaxserve.errors import EngineDeadError, EngineShuttingDown, QueueFull, RequestTimedOut
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
# A logged prompt is cut to this many characters by default: enough to recognise it, not a copy of a document.
MAX_LOGGED_PROMPT_CHARS = 1000

__all__ = ["AsyncEngine", "EngineDeadError", "EngineShuttingDown", "QueueFull", "RequestTimedOut"]

# Commands from the asyncio side to the loop thread.
_ADD, _ABORT, _STOP, _REMOVE_LORA = "add", "abort", "stop", "remove_lora"


class AsyncEngine:
    """Serve an `Engine` to asyncio code. The engine must not be used by anyone else while this runs."""

    def __init__(self, engine: StepEngine, *, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 request_timeout: float | None = None, step_timeout: float | None = DEFAULT_STEP_TIMEOUT_S,
                 log_prompts: bool = False, max_log_len: int | None = MAX_LOGGED_PROMPT_CHARS):
        """`request_timeout`: seconds after which an unfinished request is aborted (None: no limit).
        `log_prompts`: log each request's prompt (cut to `max_log_len` characters; None: whole); off by default,
        since prompts may hold private data.
        `step_timeout`: a step running longer reports the engine unhealthy, so a hung device (which neither
        fails nor returns) takes the server out of a load balancer's rotation (None: never)."""
        self.admission = Admission(max_waiting_requests)
        for name, value in (("request_timeout", request_timeout), ("step_timeout", step_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds or None, got {value}")
        self.engine, self.request_timeout, self.step_timeout = engine, request_timeout, step_timeout
        self.log_prompts, self.max_log_len = log_prompts, max_log_len
        self._commands: queue.Queue = queue.Queue()
        self._removing: dict[str, threading.Event] = {}  # adapter name -> its unload, set once applied
        self._lock = threading.Lock()  # guards _stats and _loop_exited, shared by both sides
        self._streams: dict[str, RequestStream] = {}  # owned by the loop thread
        # Beam searches by id (None: starting), owned by the asyncio side.
        self._searches: dict[str, BeamSearchStream | None] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._draining = False  # set by stop_admitting(): new requests are refused, admitted ones run on
        self._loop_exited = False  # set under the lock; afterwards nothing more is queued
        self._stats = self._collect_stats()
        self._steps = StepWatch(step_timeout)  # the watchdog ends with the loop thread, so shutdown() ends both
        self._thread = threading.Thread(target=self._run_loop, name="jaxserve-engine-loop", daemon=True)
        self._thread.start()

    # --- what the server may know about the engine ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def head(self):  # what the model's final hidden state feeds (loader/heads.py): an LM head, a classifier
        return self.engine.head

    @property
    def generation_defaults(self) -> dict:
        """The model's generation_config.json sampling defaults, for request fields left unset."""
        return self.engine.generation_defaults

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]:
        return self.engine.encode_chat(messages, add_generation_prompt, **rendering)

    @property
    def is_healthy(self) -> bool:
        alive = self._error is None and not self._stopped and not self._draining and self._thread.is_alive()
        return alive and not self.is_hung

    @property
    def is_hung(self) -> bool:
        """Whether the current step has run longer than `step_timeout` (the watchdog thread logs it)."""
        return self._steps.is_hung

    @property
    def is_draining(self) -> bool:
        return self._draining and not self._stopped

    @property
    def num_in_flight(self) -> int:
        """Requests admitted whose consumer has not yet seen their end."""
        return self.admission.num_in_flight

    def uses_request_id(self, request_id: str) -> bool:  # a request or beam search of this id is in flight here
        return request_id in self._searches or self.admission.holds(request_id)

    def stats(self) -> dict:
        """The engine's counters as of its last step, plus requests admitted but not yet producing output."""
        with self._lock:
            stats = self._stats
        return {**stats, "num_waiting_for_first_output": self.admission.num_waiting}

    # --- requests ---------------------------------------------------------------------------------------------
    async def add_request(
        self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str, priority: int = 0,
        lora_request: LoRARequest | None = None, continuing: bool = False,
    ) -> RequestStream:
        """Validate and queue a request; its outputs arrive on the returned stream.

        Raises ValueError for a bad request, QueueFull when too many are waiting, EngineDeadError when the engine
        loop has stopped: all before anything is queued. `continuing`: a later part of work already admitted (a
        beam search's next round), which neither a full queue nor a graceful shutdown's drain refuses.
        """
        self._raise_if_dead(draining_refuses=not continuing)
        self.admission.admit(request_id, bounded=not continuing)
        try:
            request = await asyncio.to_thread(
                self.engine.prepare_request, request_id, prompt, params, priority=priority, lora_request=lora_request
            )
            stream = RequestStream(request_id, self._stream_done)
            self._submit((_ADD, request, stream))
        except BaseException:
            self.admission.withdraw(request_id)
            raise
        self._log_admission(request_id, prompt, params)
        if self.request_timeout is not None:
            stream.expire_after(self.request_timeout, self._expire)
        return stream

    async def generate(
        self, prompt: str | list[int] | dict, sampling_params: SamplingParams, request_id: str, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes; stopping early aborts the request (vLLM's
        `AsyncLLM.generate`, whose parameter names these are)."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority=priority,
                                        lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def beam_search(self, prompt: str | list[int], params: BeamSearchParams, request_id: str,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> BeamSearchStream:
        """Start a beam search (engine/beam_search.py); its one finished output, a choice per beam, arrives on
        the returned stream. Raises as `add_request` does, before anything runs."""
        if request_id in self._searches:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._searches[request_id] = None  # starting: an abort meanwhile takes this entry, and is applied below
        try:
            search = await BeamSearchStream.start(self, prompt, params, request_id, priority, lora_request)
        except BaseException:
            self._searches.pop(request_id, None)
            raise
        if request_id not in self._searches:
            search.abort()
            return search
        self._searches[request_id] = search
        search.add_done_callback(lambda: self._searches.pop(request_id, None))
        return search

    async def abort(self, request_id: str) -> None:
        """Stop a request (or a beam search): its stream ends without a further output."""
        if request_id not in self._searches:
            self._submit_abort(request_id)
        elif (search := self._searches.pop(request_id)) is not None:
            search.abort()

    # --- LoRA adapters ----------------------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False) -> LoRARequest:
        """Read and check an adapter (off the event loop); ValueError if it cannot be served. `load_inplace`
        replaces the adapter of that name (Engine.add_lora)."""
        removing = self._removing.get(lora_request.lora_name)
        if removing is not None:  # unloaded a moment ago: the name is free once the loop has applied it
            await asyncio.to_thread(removing.wait)
        return await asyncio.to_thread(self.engine.add_lora, lora_request, load_inplace)

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter on the loop thread, between steps; requests already queued with it still run. A load
        of the same name waits until it is done (so an unload then a load from other files works at once)."""
        done = threading.Event()
        self._removing[lora_name] = done
        self._submit((_REMOVE_LORA, lora_name, done))

    def stop_admitting(self) -> None:
        """The first step of a graceful shutdown: new requests are refused with EngineShuttingDown (and health
        turns unhealthy, so load balancers look elsewhere) while those already admitted run to the end."""
        self._draining = True

    def stop(self) -> None:
        """Begin shutting down, without waiting: in-flight requests are aborted, their streams end with
        EngineShuttingDown, and new requests are refused."""
        self._stopped = True
        self._submit((_STOP,))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """`stop()`, then wait for the loop thread to finish."""
        self.stop()
        self._thread.join(timeout)
        self._steps.join()

    # --- both sides -------------------------------------------------------------------------------------------
    def _stream_done(self, request_id: str, still_running: bool) -> None:
        self.admission.done(request_id)
        if still_running:
            self._submit_abort(request_id)

    def _submit_abort(self, request_id: str, error: Exception | None = None) -> None:
        """Abort a request; its stream ends with `error`, or quietly when None."""
        self._submit((_ABORT, request_id, error))

    def _expire(self, stream: RequestStream) -> None:
        if not stream.finished:
            logger.warning("request %s ran past the %g s request timeout: aborting it", stream.request_id,
                           self.request_timeout)
            self._submit_abort(stream.request_id, RequestTimedOut(self.request_timeout))

    def _log_admission(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        if self.log_prompts:
            shown = repr(prompt)
            if self.max_log_len is not None and len(shown) > self.max_log_len:
                shown = shown[:self.max_log_len] + f"... ({len(shown)} characters)"
            logger.info("request %s: prompt %s, params %s", request_id, shown, params)
        else:  # never the prompt itself: it may hold private data (--log-prompts opts in)
            logger.debug("request %s admitted", request_id)

    def _submit(self, command: tuple) -> None:
        """Queue a command for the loop thread; adds are refused once the loop has exited."""
        with self._lock:
            if not self._loop_exited:
                self._commands.put(command)
                return
        if command[0] == _REMOVE_LORA:  # nothing steps the engine any more: apply it here
            self._apply(command)
        if command[0] == _ADD:
            self._raise_if_dead()
            raise EngineShuttingDown("the engine loop has stopped")

    def _raise_if_dead(self, draining_refuses: bool = True) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after a failed step: {self._error!r}")
        if self._stopped or (self._draining and draining_refuses):
            raise EngineShuttingDown("the server is shutting down")

    # --- the loop thread --------------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        try:
            self._step_until_stopped()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the engine in an unknown state
            self._die(exc)
        finally:
            self._steps.loop_ended()  # first: nothing below may keep the watchdog running
            self._close_command_queue()

    def _step_until_stopped(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._apply_commands(block=idle):
                return
            if self.engine.has_unfinished_requests():
                with self._steps.step():
                    outputs = self.engine.step()
                self._publish_stats()  # before delivery: a client that sees its answer sees these stats too
                self._deliver(outputs)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts (waiting for one if `block`). Returns False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == _STOP:
                self._end_all_streams(EngineShuttingDown("the server is shutting down"), abort=True)
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._publish_stats()
                return True

    def _apply(self, command: tuple) -> None:
        if command[0] == _ADD:
            _, request, stream = command
            try:
                self.engine.add_prepared_request(request)
            except Exception as exc:  # noqa: BLE001 - a rejected request fails alone, the engine is fine
                self.admission.started(stream)
                stream.push(exc)
                return
            self._streams[stream.request_id] = stream
        elif command[0] == _REMOVE_LORA:
            _, name, done = command
            try:
                self.engine.remove_lora(name)
            finally:
                if self._removing.get(name) is done:
                    del self._removing[name]
                done.set()
        elif command[0] == _ABORT:
            _, request_id, error = command
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.engine.abort_request(request_id)
                self.admission.started(stream)
                stream.push(END_OF_STREAM if error is None else error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while this step ran
                continue
            self.admission.started(stream)
            if output.finished:
                del self._streams[output.request_id]
            stream.push(output)  # Engine.step builds fresh outputs: nothing is shared with the loop thread

    def _die(self, exc: Exception) -> None:
        logger.error("engine step failed; marking the engine unhealthy and failing in-flight requests",
                     exc_info=exc)
        self._error = exc
        self._end_all_streams(EngineDeadError(f"the engine failed while running this request: {exc!r}"),
                              abort=False)

    def _close_command_queue(self) -> None:
        # Requests queued while the loop was exiting would otherwise wait forever: fail them.
        with self._lock:
            self._loop_exited = True
        error = EngineShuttingDown("the server is shutting down") if self._error is None else (
            EngineDeadError(f"the engine stopped after a failed step: {self._error!r}"))
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == _ADD:
                self.admission.started(command[2])
                command[2].push(error)
            elif command[0] == _REMOVE_LORA:  # a load of that name waits for it
                self._apply(command)

    def _end_all_streams(self, error: Exception, abort: bool) -> None:
        for request_id, stream in list(self._streams.items()):
            if abort:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # noqa: BLE001 - shutting down anyway; freeing blocks is best effort
                    logger.exception("could not abort request %s during shutdown", request_id)
            self.admission.started(stream)
            stream.push(error)
        self._streams.clear()

    def _publish_stats(self) -> None:
        stats = self._collect_stats()
        with self._lock:
            self._stats = stats

    def _collect_stats(self) -> dict:
        return dict(self.engine.stats())

