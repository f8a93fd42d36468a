"""`jaxserve serve` over the fake engine, as its own process: signals, exit status and serve options are tested
through the exact code path users run, without loading a model.

    python -m tests.server.fake_serve TOKENIZER_DIR STEP_DELAY [serve options...]
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
from pathlib import Path

from tests.server.helpers import ServerProcess, free_port, wait_for_health


def main(argv: list[str]) -> int:
    # The tokenizer class itself, not AutoTokenizer: AutoTokenizer's config machinery imports torch (~1.5 s a
    # process), which nothing here uses. Both give the same TokenizersBackend for a saved tokenizer.json.
    from transformers import PreTrainedTokenizerFast

    from jaxserve.cli.main import build_parser
    from jaxserve.cli.serve import listen_socket
    from jaxserve.server.launch import serve_engine
    from tests.server.fake_engine import FakeEngine

    tokenizer_dir, step_delay, *serve_argv = argv
    args = build_parser()[0].parse_args(["serve", *serve_argv])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = FakeEngine(PreTrainedTokenizerFast.from_pretrained(tokenizer_dir), step_delay=float(step_delay))
    return serve_engine(engine, args, listen_socket(args.host, args.port))


@contextlib.contextmanager
def fake_server_process(tokenizer_dir: Path, serve_args: list[str], log_path: Path, step_delay: float = 0.02,
                        scheme: str = "http", verify=True):
    """The fake-engine server on a free port; killed at the end if the test has not stopped it. `scheme` and
    `verify` (httpx's) for a server started with TLS options."""
    port = free_port()
    command = [sys.executable, "-m", "tests.server.fake_serve", str(tokenizer_dir), str(step_delay),
               "--port", str(port), *serve_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        try:
            wait_for_health(url, 60, is_alive=lambda: process.poll() is None, verify=verify)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; server log:\n{log_path.read_text()[-3000:]}") from None
        yield ServerProcess(url, log_path, process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
