#!/usr/bin/env python
"""Cold start: seconds from `jaxserve serve` to the first answered request, with an empty and then a warm
persistent compilation cache (dummy weights of a model shape, nothing downloaded).

    python scripts/bench_coldstart.py                      # on a GPU: the Llama-3-8B shape, cold then warm
    python scripts/bench_coldstart.py --shape tiny         # CI, on CPU

Each run starts the server as users do (`jaxserve serve DIR --load-format dummy`, every other option its
default, warm-up included) in a process of its own, sends one completion as soon as /health answers, and stops
the server once it is answered. Printed per run: seconds to the first answer, split into start-up and loading
(until the warm-up's progress bar appears), warm-up (until the bar completes) and the rest; the programs the
warm-up compiled and how many files the run added to the compilation cache. A run that reaches --timeout is
stopped and reported with the warm-up's last progress (programs done of all, seconds so far), so a cut-short GPU
session still learns the compile rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_synthetic import SHAPES, write_model_dir
from benchmark_table import append_row, command_line

PROGRESS = re.compile(r"Compiling step buckets:[^\r\n]*?(\d+)/(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerLog:
    """The server's stderr, read on a thread: when the warm-up's bar first appeared and how far it got."""

    def __init__(self, stream, echo):
        self.lines: list[str] = []
        self.bar_started = self.bar_done = None
        self.done = self.total = 0
        self._echo = echo
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        buf = ""
        while chunk := stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096):
            buf += chunk.decode(errors="replace")
            *parts, buf = re.split(r"[\r\n]", buf)  # tqdm redraws with \r
            for part in parts:
                self._line(part)

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        m = PROGRESS.search(line)
        if m:
            self.bar_started = self.bar_started or time.perf_counter()
            self.done, self.total = int(m[1]), int(m[2])
            if self.done == self.total and self.bar_done is None:
                self.bar_done = time.perf_counter()
            return
        self.lines.append(line)
        if self._echo:
            print(f"  server: {line}", flush=True)

    def join(self) -> None:
        self._thread.join(timeout=10)


def wait_for_first_answer(port: int, proc: subprocess.Popen, deadline: float) -> bool:
    import httpx

    url = f"http://127.0.0.1:{port}"
    # One client: a bare httpx.get builds an SSL context each poll (~60 ms of CPU), taken from the server whose start
    # is being timed.
    with httpx.Client(timeout=10) as client:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                return False
            try:
                if client.get(f"{url}/health", timeout=2).status_code == 200:
                    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
                    body = {"model": model, "prompt": "w5 w6 w7", "max_tokens": 1, "temperature": 0}
                    reply = client.post(f"{url}/v1/completions", json=body,
                                        timeout=max(1, deadline - time.perf_counter()))
                    reply.raise_for_status()
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    return False


def files_in(directory: Path) -> int:
    return sum(1 for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def start_once(model_dir: Path, cache_dir: Path, timeout: float, extra: list[str], echo: bool) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", str(model_dir), "--load-format", "dummy", "--port",
           str(port), "--compilation-cache-dir", str(cache_dir), *extra]
    files_before = files_in(cache_dir)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = ServerLog(proc.stderr, echo)
    answered = wait_for_first_answer(port, proc, t0 + timeout)
    t_answer = time.perf_counter()
    exited = proc.poll()  # None: still running (answered, or stopped at the timeout)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.join()
    result = dict(answered=answered, seconds=t_answer - t0, programs_done=log.done, programs=log.total,
                  cache_files_added=files_in(cache_dir) - files_before, exited_by_itself=exited)
    if log.bar_started is not None:
        result["load_seconds"] = log.bar_started - t0
        result["warmup_seconds"] = (log.bar_done or t_answer) - log.bar_started
    if not answered:
        result["last_lines"] = log.lines[-5:]
    return result


def describe(name: str, r: dict) -> str:
    parts = []
    if "load_seconds" in r:
        parts.append(f"start-up and loading {r['load_seconds']:.1f} s, warm-up {r['warmup_seconds']:.1f} s "
                     f"({r['programs_done']}/{r['programs']} programs)")
    parts.append(f"{r['cache_files_added']} files added to the compilation cache")
    if r["answered"]:
        return f"{name} start: first answer after {r['seconds']:.1f} s (" + "; ".join(parts) + ")"
    why = "stopped at --timeout" if r["exited_by_itself"] is None else f"the server exited ({r['exited_by_itself']})"
    return f"{name} start: NO answer in {r['seconds']:.1f} s, {why} (" + "; ".join(parts) + ")" + \
        "".join(f"\n  {line}" for line in r.get("last_lines", []))


def device_kind() -> str:
    """The first device's name, asked of a child process (jax here would take the GPU's memory)."""
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"],
                          capture_output=True, text=True, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    return done.stdout.strip() or "unknown device"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--cache-dir", help="compilation cache to use (default: a new empty one, so the first run is "
                    "cold)")
    ap.add_argument("--runs", nargs="+", choices=("cold", "warm"), default=["cold", "warm"],
                    help="cold needs an empty cache: with --cache-dir it is emptied first")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take to its first answer")
    ap.add_argument("--serve-args", default="", help="more `jaxserve serve` options, one string")
    ap.add_argument("--echo", action="store_true", help="print the server's log lines as they come")
    ap.add_argument("--json", metavar="PATH", help="write the results here after each run")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result row to this file")
    args = ap.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / args.shape).mkdir()
        model_dir = write_model_dir(args.shape, Path(tmp) / args.shape)
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "xla-cache"
        for name in args.runs:
            if name == "warm" and "cold" in results and not results["cold"]["answered"]:
                print("warm start: not run (the cold start did not finish, so the cache is not warm)", flush=True)
                break
            if name == "cold" and cache.exists():
                for p in sorted(cache.rglob("*"), reverse=True):
                    p.unlink() if p.is_file() else p.rmdir()
            results[name] = start_once(model_dir, cache, args.timeout, args.serve_args.split(), args.echo)
            print(describe(name, results[name]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    if args.append:
        cells = []
        for name in ("cold", "warm"):
            r = results.get(name)
            cells.append("not run" if r is None else f"{r['seconds']:.1f}" if r["answered"] else
                         f"> {r['seconds']:.0f} (cut at {r['programs_done']}/{r['programs']} programs)")
        r = results.get("cold") or results.get("warm")
        append_row(args.append, device_kind(), command_line("bench_coldstart.py", args.append),
                   args.shape, str(r["programs"]), *cells)


if __name__ == "__main__":
    main()
