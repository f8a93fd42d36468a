"""`jaxserve batch JOB.yaml` over several processes: the same command on every node; process 0 runs the job.

Process 0 reads the input, schedules and writes the results; the others build the same engine and run each step
it sends (cluster/follower.py), so they need the job file and the model but not the input or output files.
Every process joins first (cheap: no jax backend exists yet), then process 0 checks the input and what earlier
runs finished. The followers build their engine only when process 0 builds its own (LOAD): a job it refuses, or
one with nothing left to do, releases them at once with its reason instead of after a load and a compile.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from jaxserve.batch.job_config import BatchJob, load_job, read_job_mapping
from jaxserve.cli.cluster import Session, cluster_options, start_cluster
from jaxserve.cluster import wire
from jaxserve.errors import UserError

log = logging.getLogger("jaxserve.batch")


# Engine options that need not match: the chat template is used on process 0 alone (followers never see a
# prompt), the compilation cache is each node's own directory.
PER_PROCESS_ENGINE_OPTIONS = {"chat_template", "compilation_cache_dir", "download_dir", "generation_config"}


def join_job_cluster(args: argparse.Namespace) -> tuple[Session | None, BatchJob | None]:
    """(session, job) for a multi-process run, (None, None) for one process. Followers read only the job's model
    and engine options, so the input and output paths are checked on process 0 alone."""
    launches_ray = getattr(args, "distributed_executor_backend", "mp") == "ray"  # start_cluster picks the rest
    if not launches_ray and cluster_options(args) is None:
        return None, None
    job = load_job(args.job, check_paths=False)
    if job.engine.data_parallel_size > 1:
        raise UserError(f"engine.data_parallel_size {job.engine.data_parallel_size} runs its replicas in one "
                        "process; it cannot be combined with several processes: split the input into one job per "
                        "replica instead")
    return start_cluster(args, job.engine.engine_kwargs().get("mesh"), shared=shared_options(Path(args.job)),
                         wait_for_load=True), job


def shared_options(path: Path) -> dict:
    """What shapes the weights and the compiled programs, as the job file writes it (not as resolved: the file
    may sit in another directory on each node), one key per engine option so that a refusal names the one."""
    raw = read_job_mapping(path)
    engine = raw.get("engine") if isinstance(raw.get("engine"), dict) else {}
    options = {f"engine.{key}": value for key, value in engine.items() if key not in PER_PROCESS_ENGINE_OPTIONS}
    return {"model": raw.get("model"), **options}


def follow_job(session: Session, job: BatchJob) -> int:
    """A follower's whole run: wait for process 0's decision, then build the engine and run its steps."""
    from jaxserve.batch.job import build_engine
    from jaxserve.cluster.follower import await_load

    if not await_load(session.cluster, session.shutdown):
        log.info("process 0 released this process: the job had nothing to run")
        return 0
    leader_only = {"chat_template": None, "generation_config": None}  # only process 0 sees prompts
    session.take_role(build_engine(job.model_copy(update={"engine": job.engine.model_copy(update=leader_only)})))
    return 0  # not reached: take_role follows until process 0 releases this process, then exits


def leader_engine_factory(session: Session):
    """`run_job`'s engine builder on process 0: tell the followers to build theirs, then lead them."""
    from jaxserve.batch.job import build_engine

    def build(job: BatchJob):
        session.cluster.broadcast(wire.frame(wire.LOAD))
        return session.take_role(build_engine(job))

    return build
