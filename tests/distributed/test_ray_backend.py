"""`--distributed-executor-backend ray` on a local Ray head (loopback only): process 0 starts a follower actor,
serves a 2x2 mesh (2 fake CPU devices per process) with one process's greedy text, and SIGTERM ends it all.

Not skipped when Ray is missing: `pip install -e .[test]` installs it, and a CI without it should say so."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.distributed.procs import (
    PROMPTS,
    SMALL_ENGINE,
    complete,
    free_port,
    reference_texts,
)

# Ray picks the machine's network address unless told this is a one-machine cluster.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def ray_head():
    """`ray start --head --block` in a session of its own: stopping it kills exactly this cluster's processes
    (`ray stop` would kill every Ray process of the user on the machine)."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.fail("ray is not installed: `pip install -e .[test]` (or `pip install ray`) provides it")
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={temp}"], env={**os.environ, **LOOPBACK}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(wait)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_backend_serves_with_a_follower_actor(processes, tiny_checkpoint):
    model, http_port = str(tiny_checkpoint("llama")), free_port()
    with ray_head() as address:
        processes.start("leader", ["serve", model, "--mesh", "2x2", "--num-processes", "2", "--port", str(http_port),
                                   "--distributed-executor-backend", "ray", "--distributed-timeout", "120",
                                   *SMALL_ENGINE], devices=2, env={"RAY_ADDRESS": address, **LOOPBACK})
        url = processes.wait_healthy(http_port, timeout=180)
        served = [complete(url, model, prompt) for prompt in PROMPTS]
        assert served == reference_texts(model, "2x2")
        log = processes.log("leader")
        assert "started 1 Ray follower actor;" in log and "leading 1 follower: process 1" in log
        processes.signal("leader", signal.SIGTERM)
        rc, _ = processes.wait("leader", 60)
        assert rc == 0, processes.log("leader")[-3000:]
