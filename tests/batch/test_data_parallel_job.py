"""A batch job over data-parallel replicas (engine.data_parallel_size): every line answered once, by whichever
replica had room, as one engine would answer it; a replica's failure stops the job with every result kept."""

import threading
from types import SimpleNamespace

import pytest

from jaxserve.batch import job as job_module
from jaxserve.batch.job import run_job
from jaxserve.errors import UserError
from tests.batch.helpers import completion_line, read_jsonl, results_by_custom_id, write_job
from tests.batch.test_runner_fake_engine import LINES, SAMPLING
from tests.server.fake_engine import FakeEngine


def replica(tokenizer, step_delay=0.0):
    engine = FakeEngine(tokenizer, step_delay=step_delay)
    engine.config.scheduler = SimpleNamespace(max_num_seqs=2)  # lines per replica: 4 x 2 (default_concurrency)
    return engine


def test_lines_spread_over_the_replicas_with_one_engine_s_answers(tmp_path, smol_tokenizer):
    lines = LINES + [completion_line(f"more-{i}", f"Prompt {i}") for i in range(20)]
    replicas = [replica(smol_tokenizer, step_delay=0.001) for _ in range(2)]
    summary = run_job(write_job(tmp_path, lines, sampling=SAMPLING), engine=replicas, show_progress=False)
    alone = tmp_path / "alone"
    alone.mkdir()
    run_job(write_job(alone, lines, sampling=SAMPLING), engine=replica(smol_tokenizer), show_progress=False)

    assert (summary.total, summary.totals.succeeded, summary.totals.failed) == (34, 28, 6)
    records = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(r["custom_id"] for r in records) == sorted(line["custom_id"] for line in lines)  # each once
    assert all(engine.prompts for engine in replicas), "a replica got no line"
    assert results_by_custom_id(tmp_path / "out.jsonl") == results_by_custom_id(alone / "out.jsonl")


def test_a_failing_replica_stops_the_job_and_a_rerun_finishes_it(tmp_path, smol_tokenizer):
    lines = [completion_line(f"line-{i}", f"Prompt {i}", max_tokens=20) for i in range(30)]
    path = write_job(tmp_path, lines, sampling=SAMPLING)
    healthy, failing = replica(smol_tokenizer, step_delay=0.002), replica(smol_tokenizer, step_delay=0.002)
    steps = threading.Semaphore(3)  # the failing replica's fourth step fails
    real_step = failing.step
    failing.step = lambda: real_step() if steps.acquire(blocking=False) else (_ for _ in ()).throw(
        RuntimeError("simulated device failure"))
    with pytest.raises(RuntimeError, match="simulated device failure"):
        run_job(path, engine=[healthy, failing], show_progress=False)
    kept = read_jsonl(tmp_path / "out.jsonl")
    # The healthy replica stopped too, at its next step: long before it finished its 8 lines in flight (20 steps
    # each), let alone the 14 still waiting, which it would have run had it gone on.
    assert len(kept) < 8
    summary = run_job(path, engine=[replica(smol_tokenizer), replica(smol_tokenizer)], show_progress=False)
    assert summary.skipped == len(kept) and summary.totals.succeeded == 30 - len(kept)
    assert sorted(r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")) == sorted(f"line-{i}" for i in range(30))


def test_the_job_builds_one_replica_per_device_group(tmp_path, smol_tokenizer, monkeypatch):
    """engine.data_parallel_size: 2 over a 2x1 mesh: devices 0-1 and 2-3, the first's cache size for both, unwarmed
    until both are loaded, then warmed up."""
    built = []

    class Recorded(FakeEngine):
        def __init__(self, model, **kwargs):
            super().__init__(smol_tokenizer)
            built.append(kwargs)
            self.config.cache.num_blocks = kwargs.get("num_kv_blocks") or 77
            self.warmed_up = False

        def warmup(self, desc=""):
            self.warmed_up = True

    monkeypatch.setattr("jaxserve.engine.Engine", Recorded)
    job = job_module.load_job(write_job(tmp_path, [completion_line("a", "x")],
                                        engine={"data_parallel_size": 2, "mesh": "2x1"}))
    engines = job_module.build_engines(job)
    assert [[d.id for d in kw["devices"]] for kw in built] == [[0, 1], [2, 3]]
    assert [kw.get("num_kv_blocks") for kw in built] == [None, 77] and all(not kw["warmup"] for kw in built)
    assert [kw["seed"] for kw in built] == [0, 1]  # unseeded requests sample differently on each replica
    assert [engine.warmed_up for engine in engines] == [True, True]
    assert "data_parallel_size" not in built[0]


def test_data_parallel_mistakes_are_one_sentence(tmp_path):
    job = job_module.load_job(write_job(tmp_path, [completion_line("a", "x")],
                                        engine={"data_parallel_size": 3, "mesh": "4x1"}))
    with pytest.raises(UserError, match="3 data-parallel replicas of mesh 4x1 need 12 devices but only 8"):
        job_module.build_engines(job)
    from jaxserve.cli.batch_cluster import join_job_cluster

    args = SimpleNamespace(job=str(tmp_path / "job.yaml"), num_processes=2, coordinator="127.0.0.1:1", process_id=0,
                           distributed_executor_backend="mp")
    with pytest.raises(UserError, match="cannot be combined with several processes"):
        join_job_cluster(args)
