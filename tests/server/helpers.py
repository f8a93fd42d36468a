"""Test helpers: the default model's tokenizer, servers in a thread or a subprocess, reading /metrics."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

API_KEY = "test-key"
# A client to reuse where tests poll: a bare httpx.get builds an SSL context each time (~60 ms of CPU).
HTTP = httpx.Client()
# The real server: `jaxserve serve` with the default model (SmolLM2-135M-Instruct).
REAL_MODEL = "SmolLM2-135M-Instruct"
# 16 sequences a step, not CPU's default 64: the warm-up compiles 21 step shapes instead of 40, and the tests of
# more requests than fit in a step need 17 (test_soak.py), not 65. The hermes parser: clients that choose tools
# "auto" (test_clients.py).
REAL_SERVER_ARGS = ["--api-key", API_KEY, "--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-seqs", "16",
                    "--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def load_default_tokenizer():
    """SmolLM2's tokenizer (with its chat template), built from the default model's GGUF the way the server builds
    it (tests/loader/test_loading.py holds it equal to transformers' own reading of the GGUF)."""
    from jaxserve.loader.default_model import default_model_path
    from jaxserve.loader.gguf import GGUFFile

    return GGUFFile(default_model_path()).tokenizer()


def wait_for_health(base_url: str, timeout: float, is_alive=lambda: True, verify=True) -> None:
    # One client for all the polls: each httpx.get builds an SSL context (reads the CA bundle, ~60 ms of CPU), which
    # five polls a second turn into a core taken from the server starting beside them.
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2, verify=verify) as client:
        while time.monotonic() < deadline:
            if not is_alive():
                raise RuntimeError("the server exited before it became healthy")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout} s")


@contextlib.contextmanager
def serve_in_thread(app_or_server):
    """Run an app (or a ready uvicorn.Server) on 127.0.0.1 and a free port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = app_or_server
    if not isinstance(server, uvicorn.Server):
        server = uvicorn.Server(uvicorn.Config(app_or_server, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(base_url, timeout=30, is_alive=thread.is_alive)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    log_path: Path
    process: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def server_process(extra_args: list[str], log_path: Path, timeout: float = 600):
    """`jaxserve serve` in a subprocess on a free port, exactly as a user starts it; stopped with Ctrl-C."""
    port = free_port()
    command = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--port", str(port), *extra_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_health(url, timeout, is_alive=lambda: process.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; server log:\n{log_path.read_text()[-3000:]}") from None
        yield ServerProcess(url, log_path, process)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (the first whose labels include `labels`); 0 if absent."""
    text = HTTP.get(f"{base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
