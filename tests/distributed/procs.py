"""Child processes for multi-process tests: `jaxserve` commands on fake CPU devices, each logging to a file,
every one of them killed when the test ends, whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import FAST_COMPILE_XLA_FLAGS
from tests.server.helpers import wait_for_health

# Small buckets and no warm-up: the programs a test needs compile on first use, the same on every process.
SMALL_STEPS = ["--max-num-batched-tokens", "16", "--max-num-seqs", "2", "--no-warmup", "--dtype", "float32",
               "--log-level", "info"]
SMALL_ENGINE = ["--num-kv-blocks", "64", *SMALL_STEPS]
PROMPTS = ["Hello there", "The capital of France is"]


def free_port_pair() -> int:
    """p and p + 1 free on 127.0.0.1 (jax's coordinator and the step channel)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with contextlib.suppress(OSError):
                b.bind(("127.0.0.1", port + 1))
                return port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_args(coordinator_port: int, num: int, pid: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{coordinator_port}", "--num-processes", str(num), "--process-id", str(pid)]


class Processes:
    def __init__(self, directory: Path):
        self.directory = directory
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], devices: int = 4, env: dict | None = None) -> subprocess.Popen:
        # This many fake devices, compiled as the test process compiles (the same programs, the same roundings).
        xla_flags = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_XLA_FLAGS}"
        environment = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu", **(env or {})}
        log = open(self.directory / f"{name}.log", "w")  # noqa: SIM115 (the child writes it; closed below)
        # A session of its own: a signal meant for one child never reaches pytest or its siblings.
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "jaxserve.cli.main", *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env=environment, start_new_session=True)
        log.close()
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def wait(self, name: str, timeout: float) -> tuple[int, float]:
        """-> (exit status, seconds waited). Fails the test (with the log) if it does not exit in time."""
        start = time.monotonic()
        try:
            rc = self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not exit within {timeout} s; log:\n{self.log(name)[-3000:]}") from None
        return rc, time.monotonic() - start

    def wait_healthy(self, port: int, timeout: float = 120.0) -> str:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_health(url, timeout, is_alive=self._none_exited)
        except TimeoutError:
            raise AssertionError(f"no healthy server within {timeout} s:\n" + self.logs_tail()) from None
        return url

    def _none_exited(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) before serving:\n{self.log(name)[-3000:]}")
        return True

    def logs_tail(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes any helper it started too
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)


def complete(url: str, model: str, prompt: str, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def reference_texts(model: str, mesh: str, max_tokens: int = 8, **options) -> list[str]:
    """What one process (this pytest process, 8 fake devices) generates for PROMPTS."""
    from jaxserve import Engine, SamplingParams

    engine = Engine(model, mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=2, warmup=False,
                    dtype="float32", **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    # One prompt at a time, as the server gets them: the same step shapes, so the same programs.
    return [engine.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
