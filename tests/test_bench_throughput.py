"""scripts/bench_throughput.py keeps working (a tiny random checkpoint through --model, tiny settings; the real
figures, on SmolLM2, are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_throughput.py"


def test_bench_throughput_tiny(tiny_checkpoint, tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    model = tiny_checkpoint("llama", max_position_embeddings=2048)
    done = subprocess.run([sys.executable, str(SCRIPT), "--num-prompts", "2", "--max-tokens", "4",
                           "--hf-batch-sizes", "1", "2", "--repeats", "1", "--quantization", "int8", "--also-float32",
                           "--append", str(table), "--model", str(model)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("ratio jaxserve/transformers: ") and last.endswith("x")
    assert float(last.split(": ")[1][:-1]) > 0
    row = table.read_text()
    assert "bench_throughput.py --num-prompts 2 --max-tokens 4" in row and "| int8 (float32 in the same run: " in row
    assert "int8/float32 " in done.stdout
    assert f"--model {model}`" in row  # the row names the weights it was measured on


def test_llama_cpp_needs_a_gguf_model(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--llama-cpp", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--llama-cpp runs a GGUF file: give --model a .gguf path" in done.stderr
