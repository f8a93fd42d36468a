"""scripts/bench_serving.py keeps working: a tiny sweep against the real server, with its plot."""

import subprocess
import sys
from pathlib import Path

from tests.server.helpers import API_KEY, REAL_MODEL

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_serving.py"


def test_bench_serving_tiny_sweep(real_server, tmp_path):
    png = tmp_path / "curves.png"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--base-url", real_server.url, "--api-key", API_KEY, "--model", REAL_MODEL,
         "--num-prompts", "6", "--max-concurrency", "1", "3", "--input-len", "4", "8", "--output-len", "4", "6",
         "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert any("concurrency    3: 6 ok, 0 failed" in line for line in lines), done.stdout
    assert lines[-1].startswith("output throughput at concurrency 3:")
    assert png.stat().st_size > 10_000
