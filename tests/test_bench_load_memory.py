"""scripts/bench_load_memory.py keeps working (a tiny checkpoint; its figures are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_load_memory.py"


def test_bench_load_memory_tiny(tiny_checkpoint):
    model = tiny_checkpoint("llama", tie_word_embeddings=True)
    done = subprocess.run([sys.executable, str(SCRIPT), "--meshes", "1x1", "2x1", "--model", str(model)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.strip().splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == ["| 1x1", "| 2x1"]
    placed = [float(row.rstrip(" |").rsplit(" | ", 1)[1]) for row in rows]
    assert placed[0] > 0 and placed[1] >= placed[0]  # tensor parallel replicates the norms and embeddings
