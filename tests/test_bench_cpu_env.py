"""scripts/bench_cpu_env.py keeps working: two engine processes under two XLA:CPU schedulers, on a tiny random
checkpoint (its figures, on SmolLM2, are in BENCHMARKS.md)."""

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import write_gguf

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_cpu_env.py"


def test_bench_cpu_env_compares_the_schedulers_tiny(tiny_checkpoint, gguf_tokenizer_source, tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    # As a GGUF file: an HF directory's config and tokenizer load through transformers, which imports torch in
    # each engine process (seconds each).
    model = write_gguf(tiny_checkpoint("llama"), tmp_path / "tiny.gguf", "llama", gguf_tokenizer_source)
    done = subprocess.run([sys.executable, str(SCRIPT), "--compare", "scheduler", "--num-prompts", "1",
                           "--max-tokens", "2", "--rounds", "1", "--num-kv-blocks", "64", "--model", str(model),
                           "--append", str(table)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ratios = re.findall(r"^(1 request): sequential/concurrent (\d+\.\d\d)x$", done.stdout, re.MULTILINE)
    assert [name for name, _ in ratios] == ["1 request", "1 request"] and all(float(r) > 0 for _, r in ratios)
    rows = table.read_text().splitlines()
    assert len(rows) == 2 and all("| float32 |" in row and "| concurrent " in row and "| sequential " in row
                                  for row in rows), rows


def test_counts_below_one_are_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--rounds, --num-prompts and --max-tokens must be at least 1" in done.stderr
