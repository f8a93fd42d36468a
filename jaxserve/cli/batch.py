"""The `jaxserve batch JOB.yaml` subcommand (registered in jaxserve/cli/main.py)."""

from __future__ import annotations

import argparse
import logging

from jaxserve.errors import UserError

log = logging.getLogger("jaxserve.batch")

# The shell's convention for "stopped by Ctrl-C".
EXIT_INTERRUPTED = 130


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB.yaml",
                        help="the job: model, engine options, sampling defaults, input and output JSONL "
                             "(see configs/batch_example.yaml)")
    parser.add_argument("--validate", action="store_true",
                        help="check the job file and every input line, without loading the model or running")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_batch_command(args: argparse.Namespace) -> int:
    if args.validate:
        return _validate(args.job)
    from jaxserve.batch.job import run_job  # pulls in the server schemas; --help stays instant
    from jaxserve.batch.stop import JobInterrupted, StopSignals
    from jaxserve.cli.batch_cluster import follow_job, join_job_cluster, leader_engine_factory

    session, job = join_job_cluster(args)  # (None, None) on one process
    if session is not None and not session.cluster.is_leader:
        return follow_job(session, job)
    try:
        with StopSignals() as stop:  # a follower's Ctrl-C reaches process 0 as a SIGTERM
            run_job(args.job, show_progress=not args.no_progress, stop=stop,
                    engine_factory=leader_engine_factory(session) if session is not None else None)
    except (JobInterrupted, KeyboardInterrupt):
        log.warning("interrupted; every finished result is saved: run the same command again to finish the job")
        if session is not None:  # clean once the followers run steps: they were stopped, not failed
            session.cluster.close(reason="the batch job was interrupted before it started")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if session is not None:  # the followers stop at once, saying why, whether or not they are running steps
            session.cluster.close(clean=False, reason=f"the batch job failed: {exc}")
        raise
    if session is not None:
        session.cluster.close(clean=True)  # also when nothing was left to run and the followers built nothing
    return 0


def _validate(job: str) -> int:
    from jaxserve.batch.validate import validate_job

    report = validate_job(job)
    print(report.render())
    if report.problems:
        raise UserError(f"{len(report.problems)} problem(s) in {job}; see the list above")
    return 0
