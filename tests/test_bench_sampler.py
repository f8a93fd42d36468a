"""scripts/bench_sampler.py keeps working (tiny settings; its figures are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_sampler.py"


def test_bench_sampler_tiny(tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--vocab", "1000", "--repeats", "1",
                           "--append", str(table)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("filter speed-up: ") and float(last.removeprefix("filter speed-up: ").rstrip("x")) > 0
    assert "| `scripts/bench_sampler.py --rows 4 --vocab 1000 --repeats 1` |" in table.read_text()
