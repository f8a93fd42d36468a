"""`jaxserve batch JOB.yaml` over several processes: the same command on every node; process 0 runs the job.

Process 0 reads the input, schedules and writes the results; the others build the same engine and run each step
it sends (parallel/follower.py), so they need the job file and the model but not the input or output files.
Every process joins first (cheap: no jax backend exists yet), then process 0 checks the input and what earlier
runs finished. The followers build their engine only when process 0 builds its own (LOAD): a job it refuses, or
one with nothing left to do, releases them at once with its reason instead of after a load and a compile.
"""

from __future__ import annotations

import argparse
import logging

from jaxserve.batch.job_config import BatchJob, load_job
from jaxserve.parallel import wire
from jaxserve.parallel.multinode import Session, start_cluster

log = logging.getLogger("jaxserve.batch")


def join_job_cluster(args: argparse.Namespace) -> tuple[Session | None, BatchJob | None]:
    """(session, job) for a multi-process run, (None, None) for one process. Followers read only the job's model
    and engine options, so the input and output paths are checked on process 0 alone."""
    from jaxserve.parallel.multinode import cluster_options

    if cluster_options(args) is None and getattr(args, "distributed_executor_backend", "mp") != "ray":
        return None, None
    job = load_job(args.job, check_paths=False)
    engine_options = job.engine.engine_kwargs()
    # What shapes the weights and the compiled programs must agree everywhere (checked as the processes join).
    shared = {"model": job.model, "engine": engine_options}
    return start_cluster(args, engine_options.get("mesh"), shared=shared, wait_for_load=True), job


def follow_job(session: Session, job: BatchJob) -> int:
    """A follower's whole run: wait for process 0's decision, then build the engine and run its steps."""
    from jaxserve.batch.job import build_engine
    from jaxserve.parallel.follower import await_load

    if not await_load(session.cluster, session.shutdown):
        log.info("process 0 released this process: the job had nothing to run")
        return 0
    session.take_role(build_engine(job))  # follows until process 0 releases it, then exits
    return 0


def leader_engine_factory(session: Session):
    """`run_job`'s engine builder on process 0: tell the followers to build theirs, then lead them."""
    from jaxserve.batch.job import build_engine

    def build(job: BatchJob):
        session.cluster.broadcast(wire.frame(wire.LOAD))
        return session.take_role(build_engine(job))

    return build
