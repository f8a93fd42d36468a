"""Where a process finds its place in a cluster: flags, then JAX_* variables, then a Kubernetes LeaderWorkerSet's
LWS_* variables, then the cluster jax.distributed detects (SLURM here); a bad value is named."""

import argparse
import os

import pytest

from jaxserve.cli import cluster
from jaxserve.errors import UserError

CLUSTER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_PORT",
                     "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_"))]:
        monkeypatch.delenv(name)
    cluster._detected_cluster.cache_clear()
    yield
    cluster._detected_cluster.cache_clear()


def flags(coordinator=None, num_processes=None, process_id=None) -> argparse.Namespace:
    return argparse.Namespace(coordinator=coordinator, num_processes=num_processes, process_id=process_id)


def lws(monkeypatch, index: int, size: int = 4, leader: str = "serve-0.serve.default") -> None:
    monkeypatch.setenv("LWS_LEADER_ADDRESS", leader)
    monkeypatch.setenv("LWS_GROUP_SIZE", str(size))
    monkeypatch.setenv("LWS_WORKER_INDEX", str(index))


def test_one_process_without_flags_or_variables():
    assert cluster.cluster_options(flags()) is None and cluster.is_leader(flags())


def test_leaderworkerset_variables_place_each_pod(monkeypatch):
    lws(monkeypatch, index=2)
    options = cluster.cluster_options(flags())
    assert (options.coordinator, options.num_processes, options.process_id) == ("serve-0.serve.default:8476", 4, 2)
    assert not cluster.is_leader(flags()) and cluster._settings(flags())[3] == "the LeaderWorkerSet's LWS_* variables"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "9100")
    assert cluster.cluster_options(flags()).coordinator == "serve-0.serve.default:9100"
    lws(monkeypatch, index=0)
    assert cluster.is_leader(flags())


def test_flags_then_jax_variables_win_over_the_leaderworkerset(monkeypatch):
    lws(monkeypatch, index=2)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:7000")
    options = cluster.cluster_options(flags(process_id=3))
    assert (options.coordinator, options.num_processes, options.process_id) == ("10.0.0.1:7000", 4, 3)
    assert cluster.cluster_options(flags(num_processes=1)) is None  # one process, whatever the pod says


def test_a_bad_variable_is_named(monkeypatch):
    lws(monkeypatch, index=1)
    monkeypatch.setenv("LWS_GROUP_SIZE", "two")
    with pytest.raises(UserError, match="LWS_GROUP_SIZE='two' is not valid"):
        cluster.cluster_options(flags())
    lws(monkeypatch, index=5, size=2)
    with pytest.raises(UserError, match="process id 5 is outside 0..1"):
        cluster.cluster_options(flags())


def test_processes_compare_engine_options_and_runtime_lora_updating_not_the_server_s_own():
    from tests.test_cli import parse

    shared = cluster.fingerprint(parse(["serve", "--enable-runtime-lora-updating", "--port", "9000", "--max-num-seqs",
                                        "4"]))
    assert shared["enable_runtime_lora_updating"] is True and shared["max_num_seqs"] == 4  # a follower must match
    assert "port" not in shared and "api_key" not in shared  # process 0 alone serves HTTP


def test_a_slurm_job_step_is_found_as_jax_distributed_finds_it(monkeypatch):
    for name, value in dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[3-4]", SLURM_NTASKS="2", SLURM_PROCID="1",
                            SLURM_LOCALID="0").items():
        monkeypatch.setenv(name, value)
    options = cluster.cluster_options(flags())
    assert (options.num_processes, options.process_id) == (2, 1)
    assert options.coordinator.startswith("node3:") and not cluster.is_leader(flags())
    # jax takes the port from the job id (61440 + id % 4096), unless JAX_COORDINATOR_PORT says; the last port
    # leaves no next one for the step channel, so the one before is taken (by every process alike)
    for job, port in (("7", 61447), ("4095", 65534)):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        cluster._detected_cluster.cache_clear()
        assert cluster.cluster_options(flags()).coordinator == f"node3:{port}"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "9000")
    cluster._detected_cluster.cache_clear()
    assert cluster.cluster_options(flags()).coordinator == "node3:9000"
    # A flag still decides: one process inside the job
    assert cluster.cluster_options(flags(num_processes=1)) is None
