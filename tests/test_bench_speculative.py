"""scripts/bench_speculative.py keeps working (a tiny random checkpoint through --model, tiny settings; the real
figures, on SmolLM2, are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_speculative.py"


def test_bench_speculative_tiny(tiny_checkpoint, tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    model = tiny_checkpoint("llama", max_position_embeddings=2048)
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-prompts", "1", "--max-tokens", "6", "--repeats", "1",
                           "--append", str(table), "--model", str(model)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("speedup with ngram speculation: ") and last.endswith("x")
    assert float(last.split(": ")[1][:-1]) > 0
    row = table.read_text()
    assert "bench_speculative.py --num-prompts 1 --max-tokens 6" in row and row.count("|") == 11
