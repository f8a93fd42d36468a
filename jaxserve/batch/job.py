"""One batch job from start to end: check everything, skip what earlier runs finished, run the rest.

Everything that can be checked without the model (the job file, every input line, duplicate custom_ids, the
result files) is checked first, so a mistake costs a second rather than a model load.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from jaxserve.batch.input_file import BadLine, InputScan, scan_input
from jaxserve.batch.job_config import BatchJob, load_job
from jaxserve.batch.problems import JobError
from jaxserve.batch.progress import BatchProgress
from jaxserve.batch.records import bad_line
from jaxserve.batch.replicas import run_on_replicas
from jaxserve.batch.result_log import ResultLog
from jaxserve.batch.runner import BatchRunner, RunTotals
from jaxserve.batch.stop import StopSignals
from jaxserve.errors import UserError
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.response_bodies import OutputParsers
from jaxserve.server.tool_parsers import tool_call_parser

log = logging.getLogger("jaxserve.batch")

# Lines kept in the engine per sequence slot: enough waiting work that every step can be filled.
CONCURRENCY_PER_SEQUENCE_SLOT = 4


@dataclass
class JobSummary:
    total: int  # results the job ends with (one per input line)
    skipped: int  # already in the output from earlier runs
    totals: RunTotals  # this run's results
    generated_tokens: int = 0


def run_job(path: str | Path, *, engine=None, engine_factory=None, show_progress: bool = True,
            stop: StopSignals | None = None) -> JobSummary:
    """Run (or resume) the job in `path`. `engine`: an Engine (or a list of data-parallel replicas) to use instead
    of building the job's own; `engine_factory(job)`: how to build it when there is work to do (default:
    `build_engines`); `stop`: checked before the engine is built and between steps (JobInterrupted once a stop was
    asked for)."""
    job = load_job(path)
    scan = scan_input(job.input)
    if scan.duplicates:
        raise JobError(Path(path), scan.duplicates)
    with ResultLog(job.output, job.errors) as results:
        todo = [entry for entry in scan.entries if entry.key not in results.done]
        _log_resume(scan, results.done, len(todo), job, results.retried)
        # Lines that are no request at all get their records at once: no model is loaded for them alone.
        unreadable = [entry for entry in todo if isinstance(entry, BadLine)]
        for entry in unreadable:
            results.write(bad_line(entry))
        results.commit()
        todo = [entry for entry in todo if not isinstance(entry, BadLine)]
        if not todo:
            return JobSummary(len(scan.entries), len(scan.entries) - len(unreadable),
                              RunTotals(failed=len(unreadable)))
        stop_check = stop.check if stop is not None else lambda: None
        stop_check()
        # One process loading its own model stops at once on a signal; a cluster's processes load together, so
        # process 0 stops after the load, with the followers (cli/batch_cluster.py).
        loading = stop.at_once() if stop is not None and engine is None and engine_factory is None else \
            contextlib.nullcontext()
        with loading:
            engines = engine if engine is not None else (engine_factory or build_engines)(job)
        engines = engines if isinstance(engines, list) else [engines]
        progress = BatchProgress(len(scan.entries), len(scan.entries) - len(todo), enabled=show_progress)
        runners = [BatchRunner(replica, results, progress, sampling_defaults=job.sampling,
                               served_model_names=job.served_model_name or [replica.model_name],
                               max_concurrency=job.max_concurrency or default_concurrency(replica),
                               stop_check=stop_check, parsers=OutputParsers(
                                   tool_call_parser(job.tool_call_parser),
                                   reasoning_parser(job.reasoning_parser, replica.tokenizer)),
                               lora_adapters=replica.adapters.preloaded) for replica in engines]
        try:
            totals = run_on_replicas(runners, todo)
        finally:
            progress.close()
    totals.failed += len(unreadable)
    summary = JobSummary(len(scan.entries), len(scan.entries) - len(todo) - len(unreadable), totals,
                         progress.generated_tokens)
    log.info("done: %d results in %s (%d ok and %d failed in this run, %d from earlier runs); %.1f tokens/s",
             summary.total, job.output, totals.succeeded, totals.failed, summary.skipped, progress.tokens_per_second)
    return summary


def build_engines(job: BatchJob) -> list:
    """The job's engine, or with `data_parallel_size: N` its N replicas on disjoint devices (async_engine/data_parallel.py)."""
    replicas = job.engine.data_parallel_size
    if replicas == 1:
        return [build_engine(job)]
    from jaxserve.async_engine.data_parallel import build_replicas

    def replica(devices, **overrides):
        return build_engine(job, devices=devices, warmup=False, **overrides)

    try:
        return build_replicas(replica, job.engine.engine_kwargs().get("mesh"), replicas, job.engine.seed or 0,
                              warmup=job.engine.warmup is not False)
    except ValueError as exc:  # too few devices for the replicas (an engine's own errors are UserErrors already)
        raise UserError(str(exc)) from None


def build_engine(job: BatchJob, **overrides):
    """The Engine the job describes (`overrides`: Engine keywords laid over its options); its user-facing errors
    (bad mesh, missing file...) become UserError."""
    from jaxserve.engine import Engine  # imports jax: only now that it is needed

    try:
        return Engine(job.model, **(job.engine.engine_kwargs() | overrides))
    except (ValueError, OSError) as exc:  # the engine words these for people (docs/architecture.md: errors are for people)
        raise UserError(str(exc)) from None


def default_concurrency(engine) -> int:
    return CONCURRENCY_PER_SEQUENCE_SLOT * engine.config.scheduler.max_num_seqs


def _log_resume(scan: InputScan, done: set, todo: int, job: BatchJob, retried: int) -> None:
    keys = {entry.key for entry in scan.entries}
    strangers = len(done - keys)
    if strangers:
        log.warning("%s holds %d results for custom_ids that are not in %s (was the input changed?)",
                    job.output, strangers, job.input)
    finished = len(scan.entries) - todo
    if not todo:
        log.info("nothing to do: all %d lines of %s already have results in %s", finished, job.input, job.output)
    elif finished or retried:
        log.info("resuming: %d of %d lines already have results; running the other %d", finished,
                 len(scan.entries), todo)
    if retried:
        log.info("%d results of earlier runs were failures: their lines run again", retried)
