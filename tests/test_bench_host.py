"""scripts/bench_host.py keeps working (tiny settings; its figures are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_host.py"


def test_bench_host_tiny(smollm2_gguf_path, tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-seqs", "4", "--prompt-len", "8", "--max-tokens", "4",
                           "--repeats", "1", "--append", str(table)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("host ms per step at 4 sequences: ") and float(last.rsplit(" ", 1)[1]) > 0
    assert "| `scripts/bench_host.py --num-seqs 4" in table.read_text()
