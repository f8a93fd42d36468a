"""scripts/bench_layer_loop.py keeps working (tiny settings; its GPU figures are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_layer_loop.py"


def test_bench_layer_loop_tiny(tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--iters", "2", "--append", str(table)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("scan / unrolled at batch 1: ") and float(last.rsplit(" ", 1)[1].rstrip("x")) > 0
    assert "scan program: " in done.stdout
    assert "| `scripts/bench_layer_loop.py --shape tiny --iters 2` | tiny |" in table.read_text()
