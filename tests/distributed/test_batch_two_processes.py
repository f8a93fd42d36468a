"""`jaxserve batch` on two processes x 4 fake CPU devices (one 4x2 mesh): interrupted from the follower and
resumed, the same results as one process; the follower needs only the job file and the model; a job process 0
refuses, or one with nothing left to run, releases the follower at once, saying why, without building an engine."""

import shutil
import signal
import time

from jaxserve.batch.job import run_job
from tests.batch.helpers import completion_line, results_by_custom_id, write_job
from tests.distributed.procs import cluster_args, free_port_pair

ENGINE = {"mesh": "4x2", "dtype": "float32", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64,
          "warmup": False}
LINES = [completion_line(f"line-{i}", prompt, max_tokens=6, temperature=0)
         for i, prompt in enumerate(["Hello there", "The capital of France is", "Once upon a time", "1, 2, 3,"])]
# Long enough (8 x 12 tokens, 2 at a time on the two pipeline stages, one sequence a tick: about 80 ticks after the
# first result) that a signal after the first result lands mid-job.
LONG_LINES = [completion_line(f"story-{i}", f"Story number {i}:", max_tokens=12, temperature=0, ignore_eos=True)
              for i in range(8)]
BOUND = 60  # seconds for a run that builds no engine: imports and the join, on a loaded CI machine


def start_pair(processes, leader_job, follower_job, *extra):
    port = free_port_pair()
    processes.start("p0", ["batch", str(leader_job), "--no-progress", *cluster_args(port, 2, 0), *extra])
    processes.start("p1", ["batch", str(follower_job), "--no-progress", *cluster_args(port, 2, 1), *extra])


def follower_copy(job, directory):
    """The job file alone, in a directory without the input: a follower never reads it."""
    directory.mkdir()
    return shutil.copy(job, directory / job.name)


def test_interrupted_and_resumed_on_two_processes_equals_one_process_then_a_rerun_has_nothing_to_do(
        processes, tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama"))
    (tmp_path / "two").mkdir()
    job = write_job(tmp_path / "two", LONG_LINES, model=model, engine=ENGINE)
    follower_job = follower_copy(job, tmp_path / "follower")
    start_pair(processes, job, follower_job)
    output = job.parent / "out.jsonl"
    assert wait_for(lambda: output.exists() and output.read_text().count("\n") >= 1), processes.logs_tail()
    processes.signal("p1", signal.SIGTERM)  # a follower's SIGTERM ends the job as Ctrl-C on process 0 does
    assert processes.wait("p0", BOUND)[0] == 130 and processes.wait("p1", BOUND)[0] == 0, processes.logs_tail()
    assert "every finished result is saved" in processes.log("p0") and "following process 0" in processes.log("p1")
    saved = output.read_text().count("\n")
    assert 1 <= saved < len(LONG_LINES)

    start_pair(processes, job, follower_job)  # the same command again finishes the job
    for name in ("p0", "p1"):
        rc, _ = processes.wait(name, 300)
        assert rc == 0, processes.logs_tail()
    assert f"resuming: {saved} of {len(LONG_LINES)} lines" in processes.log("p0")

    (tmp_path / "one").mkdir()
    alone = write_job(tmp_path / "one", LONG_LINES, model=model, engine=ENGINE)
    run_job(alone, show_progress=False)  # this process: 8 fake devices, the same 4x2 mesh
    two, one = results_by_custom_id(output), results_by_custom_id(alone.parent / "out.jsonl")
    assert set(two) == {line["custom_id"] for line in LONG_LINES} and all(s == 200 for s, _ in two.values())
    assert two == one

    start_pair(processes, job, follower_job)  # and once more: every line is done, so no engine is built
    for name in ("p0", "p1"):
        rc, _ = processes.wait(name, BOUND)
        assert rc == 0, processes.logs_tail()
    assert "nothing to do" in processes.log("p0")
    assert "released this process: the job had nothing to run" in processes.log("p1")


def wait_for(condition, timeout=300.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def test_a_job_process_0_refuses_stops_the_follower_with_the_reason(processes, tiny_checkpoint, tmp_path):
    duplicated = LINES + [LINES[0]]
    job = write_job(tmp_path, duplicated, model=str(tiny_checkpoint("llama")), engine=ENGINE)
    start_pair(processes, job, job)
    for name in ("p0", "p1"):
        rc, _ = processes.wait(name, BOUND)
        assert rc != 0, processes.logs_tail()
    assert "custom_id" in processes.log("p0") and "line-0" in processes.log("p0")
    follower = processes.log("p1")
    assert "process 0 stopped every process: the batch job failed" in follower and "line-0" in follower, follower
    assert "following process 0" not in follower  # it never built an engine
    for name in ("p0", "p1"):  # both left through jax's exit barrier together: no native abort after the error
        assert "Check failure" not in processes.log(name), processes.log(name)[-3000:]


def test_the_ray_backend_needs_no_coordinator_or_process_id(tmp_path, monkeypatch):
    """With --distributed-executor-backend ray, process 0 starts the others and picks the coordinator itself
    (checked end to end with serve in test_ray_backend.py); the batch command must hand it the job's mesh."""
    import argparse

    from jaxserve.cli import batch_cluster as cluster
    from jaxserve.config import MeshShape

    calls = []
    monkeypatch.setattr(cluster, "start_cluster", lambda args, mesh, **kw: calls.append((mesh, kw)) or "session")
    job = write_job(tmp_path, LINES, engine=ENGINE)
    args = argparse.Namespace(job=str(job), distributed_executor_backend="ray", num_processes=3, coordinator=None,
                              process_id=None)
    session, loaded = cluster.join_job_cluster(args)
    assert session == "session" and loaded.engine.mesh == MeshShape(4, 2)
    assert calls[0][0] == MeshShape(4, 2) and calls[0][1]["wait_for_load"] is True
