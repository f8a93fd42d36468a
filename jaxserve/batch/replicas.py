"""A job's lines over several data-parallel replicas (`engine.data_parallel_size`): one BatchRunner per replica,
each stepping its engine in its own thread (jax releases the GIL while the devices compute) and taking the next
line from one shared queue whenever it has room, so a replica that finishes early takes more.

The runners share the result log and the progress bar (both locked). One runner's failure, or a stop asked for,
ends the others at their next step; every result finished by then is on disk, so a re-run resumes.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from jaxserve.batch.input_file import BadLine, InputItem
from jaxserve.batch.runner import BatchRunner, RunTotals


class AnotherReplicaFailed(Exception):
    """Ends a runner because another one failed: that failure, not this, is what the job raises."""


def run_on_replicas(runners: list[BatchRunner], entries: list[InputItem | BadLine]) -> RunTotals:
    waiting = deque(entries)
    if len(runners) == 1:
        return runners[0].run(waiting)
    failed = threading.Event()
    for runner in runners:
        runner.stop_check = _stopping_on(failed, runner.stop_check)

    def run(runner: BatchRunner) -> RunTotals:
        try:
            return runner.run(waiting)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(len(runners), thread_name_prefix="jaxserve-batch") as pool:
        futures = [pool.submit(run, runner) for runner in runners]
    errors = [f.exception() for f in futures if f.exception() is not None]
    first = next((e for e in errors if not isinstance(e, AnotherReplicaFailed)), None)
    if first is not None:
        raise first
    return RunTotals(sum(f.result().succeeded for f in futures), sum(f.result().failed for f in futures))


def _stopping_on(failed: threading.Event, stop_check):
    def check() -> None:
        stop_check()  # a stop asked for is raised as itself
        if failed.is_set():
            raise AnotherReplicaFailed
    return check
