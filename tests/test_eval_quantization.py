"""int8 SmolLM2 and its fp8 KV cache against the float model (scripts/eval_quantization.py): the accuracy
BENCHMARKS.md states.

Measured: int8 perplexity 15.461 -> 15.538 (+0.5%), next-token agreement 98.2%; fp8 (e4m3) KV cache 15.768
(+2.0%), 96.0%. The bounds leave room for the summation-order noise between platforms, and fail on any real
quantization error (a wrong scale axis, a lost channel or a value that overflowed multiplies the perplexity)."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "eval_quantization.py"


def test_int8_weights_and_an_fp8_kv_cache_stay_close_to_float(smollm2_gguf_path, tmp_path):
    """Both variants in one run, against one float run (the script measures the reference once)."""
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--max-tokens", "8", "--variant", "int8", "--variant",
                           "none,fp8", "--append", str(table)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    int8_summary, int8_last, fp8_summary, fp8_last = done.stdout.strip().splitlines()[-4:]

    ratio = float(re.fullmatch(r"perplexity ratio int8/float: ([\d.]+)", int8_last).group(1))
    agreement = float(re.search(r"next-token agreement ([\d.]+)%", int8_summary).group(1))
    assert 0.98 < ratio < 1.02, int8_summary
    assert agreement >= 95.0, int8_summary

    ratio = float(re.fullmatch(r"perplexity ratio fp8 KV cache/float: ([\d.]+)", fp8_last).group(1))
    agreement = float(re.search(r"next-token agreement ([\d.]+)%", fp8_summary).group(1))
    assert 1.0 < ratio < 1.04, fp8_summary  # float8 rounds K and V: some loss, and a small one
    assert agreement >= 93.0, fp8_summary

    rows = table.read_text()
    assert "`scripts/eval_quantization.py --max-tokens 8`" in rows
    assert "`scripts/eval_quantization.py --max-tokens 8 --quantization none --kv-cache-dtype fp8`" in rows


def test_a_malformed_variant_is_named():
    done = subprocess.run([sys.executable, str(SCRIPT), "--variant", "int4"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "'int4': a variant is QUANTIZATION[,KV_CACHE_DTYPE]" in done.stderr, done.stderr
