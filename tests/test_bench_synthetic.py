"""scripts/bench_synthetic.py keeps working (tiny shape on CPU; its GPU figures go in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_synthetic.py"


def test_bench_synthetic_tiny(tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny", "--num-prompts", "4", "--input-len", "16",
                           "--output-len", "4", "--decode-lens", "4", "12", "--bandwidth-mib", "16",
                           "--hf-num-prompts", "4", "--hf-batch-sizes", "2", "4", "--append", str(table)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("batch-1 decode: ") and "x the roofline" in line for line in lines)
    assert any("0 programs compiled in that run" in line for line in lines)  # the best run is a warm one
    last = lines[-1]
    assert last.startswith("ratio jaxserve/transformers: ") and float(last.split(": ")[1][:-1]) > 0
    assert "bench_synthetic.py --shape tiny" in table.read_text()


def test_bench_synthetic_refuses_bad_lengths():
    done = subprocess.run([sys.executable, str(SCRIPT), "--decode-lens", "8", "8"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--decode-lens needs 0 < SHORT < LONG, got 8 8" in done.stderr
