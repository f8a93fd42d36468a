"""A SIGTERM that reaches a process of a cluster before jaxserve's server, batch job or follower loop handles
signals (the model loading or compiling: minutes on a large model) ends it: jax.distributed's preemption service
took SIGTERM over and only recorded it, so every process ran on. Ctrl-C on the leader ends it with its own status
too (130), not a generic 1."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.procs import free_port_pair

ROOT = Path(__file__).parents[2]

SIGNALLED_AFTER = """
import logging, os, signal, sys, time
from jaxserve.cluster.distributed import ClusterOptions, initialize_jax, join
logging.basicConfig(level=logging.INFO)
options = ClusterOptions(sys.argv[1], num_processes=1, process_id=0, timeout=60)
join(options, fingerprint={}) if sys.argv[2] == "join" else initialize_jax(options)
print("joined", flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[3]))
time.sleep(10)
print("still running", flush=True)
"""


# join: the leader, whose SIGTERM exits in order (the followers are released, told why); jax.distributed alone:
# the moment before a follower's handlers are in place, where the signal's default action ends the process.
@pytest.mark.parametrize("joined_by, signal_name, status",
                         [("join", "SIGTERM", 143), ("join", "SIGINT", 130), ("initialize_jax", "SIGTERM", -15)])
def test_a_signal_before_signals_are_handled_ends_the_process(joined_by, signal_name, status):
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AFTER, f"127.0.0.1:{free_port_pair()}", joined_by,
                           signal_name],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert "joined" in done.stdout and "still running" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.returncode == status, done.stderr[-2000:]
    if joined_by == "join":
        assert f"{signal_name} before serving began: stopping every process" in done.stderr
