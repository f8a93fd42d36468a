"""A job's lines over several data-parallel replicas (`engine.data_parallel_size`): one BatchRunner per replica,
each stepping its engine in its own thread (jax releases the GIL while the devices compute) and taking the next
line from one shared queue whenever it has room, so a replica that finishes early takes more.

The runners share the result log and the progress bar (both locked). One runner's failure, or a stop asked for,
ends the others before their next step; every result finished by then is on disk, so a re-run resumes. The
threads are daemons, so a second Ctrl-C ends the process at once, as with one engine.
"""

from __future__ import annotations

import threading
from collections import deque

from jaxserve.async_engine.data_parallel import raise_first, run_side_by_side
from jaxserve.batch.input_file import BadLine, InputItem
from jaxserve.batch.runner import BatchRunner, RunTotals
from jaxserve.batch.stop import JobInterrupted


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

    totals, errors = run_side_by_side([lambda runner=runner: run(runner) for runner in runners], "jaxserve-batch")
    # A replica's own failure is the job's; a stop only when nothing failed; the others' ends follow from those.
    raise_first([e for e in errors if e is not None and not isinstance(e, (AnotherReplicaFailed, JobInterrupted))])
    raise_first([e for e in errors if isinstance(e, JobInterrupted)])
    return RunTotals(sum(t.succeeded for t in totals), sum(t.failed for t in totals))


def _stopping_on(failed: threading.Event, stop_check):
    def check() -> None:
        stop_check()  # a stop asked for is raised as itself
        if failed.is_set():
            raise AnotherReplicaFailed
    return check
