"""Running a job's requests on the engine directly: continuous batching, each result saved as it finishes.

Up to `max_concurrency` batch lines are in the engine at once; whenever some finish, the next lines go in, so the
scheduler always has work to pack into each step. Requests are prepared exactly as the HTTP routes prepare them
(`endpoints.prepare`), so a refusal is the HTTP API's own status and error body.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxserve.batch.beam_searches import BeamSearches
from jaxserve.batch.endpoints import PreparedRequest, new_request_id, prepare
from jaxserve.batch.input_file import BadLine, InputItem
from jaxserve.batch.progress import BatchProgress
from jaxserve.batch.records import BatchOutputLine, bad_line, refused, succeeded
from jaxserve.batch.result_log import ResultLog
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams
from jaxserve.server.errors import APIError, bad_request, from_exception
from jaxserve.server.protocol import request_origin
from jaxserve.server.request_bodies import with_cache_salt
from jaxserve.server.response_bodies import OutputParsers


@dataclass
class InFlight:
    """One batch line in the engine: one engine request per prompt, and their final outputs as they come."""

    item: InputItem
    prepared: PreparedRequest
    engine_ids: list[str]
    finals: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.finals) == len(self.engine_ids)

    def record(self) -> BatchOutputLine:
        body = self.prepared.response_body([self.finals[engine_id] for engine_id in self.engine_ids])
        return succeeded(self.item.custom_id, self.prepared.request_id, body)


@dataclass
class RunTotals:
    succeeded: int = 0
    failed: int = 0


class BatchRunner:
    def __init__(self, engine, results: ResultLog, progress: BatchProgress, *, sampling_defaults: dict,
                 served_model_names: list[str], max_concurrency: int, stop_check=lambda: None,
                 parsers: OutputParsers = OutputParsers(), lora_adapters: dict | None = None):
        self.engine = engine
        self.results = results
        self.progress = progress
        self.sampling_defaults = sampling_defaults
        self.served_model_names = served_model_names
        self.max_concurrency = max_concurrency
        self.stop_check = stop_check  # raises to end the run between steps
        self.parsers = parsers  # the job's tool_call_parser (tool_choice "auto" in chat bodies), reasoning_parser
        self.lora_adapters = lora_adapters or {}  # name -> LoRARequest: bodies whose `model` names one use it
        self.totals = RunTotals()
        self._lines_in_flight = 0
        self._owner: dict[str, InFlight] = {}  # engine request id -> its batch line
        self._tokens_seen: dict[str, int] = {}  # engine request id -> generated tokens counted so far
        self._beam_searches = BeamSearches(engine)  # use_beam_search lines: their rounds of engine requests

    def run(self, waiting: deque[InputItem | BadLine]) -> RunTotals:
        """Run lines from `waiting` until it is empty and every line started has its result. Other runners (one
        per data-parallel replica, each in its own thread) may take from the same deque: each takes a line
        whenever it has room for one."""
        while True:
            self.stop_check()  # before taking more lines
            while self._lines_in_flight < self.max_concurrency and (entry := _take(waiting)) is not None:
                self._start(entry)
            if self._lines_in_flight:
                self._step()
            self.results.commit()  # everything finished so far is on disk before the next step
            if not self._lines_in_flight and not waiting:
                return self.totals

    def _start(self, entry: InputItem | BadLine) -> None:
        if isinstance(entry, BadLine):
            self._save(bad_line(entry))
            return
        request_id = new_request_id(entry.url)
        try:
            with request_origin(entry.origin):
                prepared = prepare(entry.url, entry.body, self.sampling_defaults, request_id, self.engine,
                                   self.served_model_names, self.parsers, self.lora_adapters)
            if isinstance(prepared.params, BeamSearchParams):
                self._start_beam_searches(entry, prepared)
                return
            requests = [self.engine.prepare_request(engine_id, with_cache_salt(prompt, prepared.cache_salt),
                                                    prepared.params.clone(), priority=prepared.priority,
                                                    lora_request=prepared.lora_request)
                        for engine_id, prompt in zip(_engine_ids(request_id, prepared), prepared.prompts)]
        except APIError as exc:
            self._save(refused(entry.custom_id, request_id, exc))
            return
        except ValueError as exc:  # the engine's own refusal (too long, a bad grammar, ...), a 400 over HTTP too
            self._save(refused(entry.custom_id, request_id, bad_request(str(exc), param=getattr(exc, "param", None))))
            return
        except Exception as exc:  # noqa: BLE001 (a line that fails unexpectedly is its own 500, as over HTTP, and
            # the job goes on: every rerun would otherwise stop at the same line and the job could never finish)
            self._save(refused(entry.custom_id, request_id, from_exception(exc)))
            return
        flight = InFlight(entry, prepared, [request.request_id for request in requests])
        for request in requests:
            self.engine.add_prepared_request(request)
            self._owner[request.request_id] = flight
        self._lines_in_flight += 1

    def _start_beam_searches(self, entry: InputItem, prepared: PreparedRequest) -> None:
        """One search per prompt; a ValueError, raised before any is queued, is the line's refusal as over HTTP."""
        engine_ids = _engine_ids(prepared.request_id, prepared)
        self._beam_searches.start(dict(zip(engine_ids, prepared.prompts)), prepared.params, prepared.priority,
                                  prepared.lora_request)
        flight = InFlight(entry, prepared, engine_ids)
        for engine_id in engine_ids:
            self._owner[engine_id] = flight
        self._lines_in_flight += 1

    def _step(self) -> None:
        for output in self.engine.step():
            if self._beam_searches.owns(output.request_id):
                output = self._beam_searches.round_finished(output) if output.finished else None
                if output is None:
                    continue
            self._count_tokens(output)
            if output.finished:
                self._finish(output)

    def _count_tokens(self, output: RequestOutput) -> None:
        if not isinstance(output, RequestOutput):  # an embedding generates nothing
            return
        generated = sum(len(completion.token_ids) for completion in output.outputs)
        self.progress.tokens_generated(generated - self._tokens_seen.get(output.request_id, 0))
        self._tokens_seen[output.request_id] = generated

    def _finish(self, output: RequestOutput) -> None:
        flight = self._owner.pop(output.request_id)
        self._tokens_seen.pop(output.request_id, None)
        flight.finals[output.request_id] = output
        if flight.finished:
            self._lines_in_flight -= 1
            self._save(flight.record())

    def _save(self, record: BatchOutputLine) -> None:
        self.results.write(record)
        if record.failed:
            self.totals.failed += 1
        else:
            self.totals.succeeded += 1
        self.progress.request_done()


def _take(waiting: deque):
    """The next line, or None: popleft is atomic, so runners in several threads never take the same one."""
    try:
        return waiting.popleft()
    except IndexError:
        return None


def _engine_ids(request_id: str, prepared: PreparedRequest) -> list[str]:
    """One engine request id per prompt, named as the HTTP server names them."""
    if len(prepared.prompts) == 1:
        return [request_id]
    return [f"{request_id}-{index}" for index in range(len(prepared.prompts))]
