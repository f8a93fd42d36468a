"""int8 SmolLM2 against the float model (scripts/eval_quantization.py): the accuracy BENCHMARKS.md states.

Measured: perplexity 15.461 -> 15.538 (+0.5%), next-token agreement 98.2%. The bounds leave room for the
summation-order noise between platforms, and fail on any real quantization error (a wrong scale axis or a lost
channel multiplies the perplexity)."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "eval_quantization.py"


def test_int8_smollm2_stays_close_to_float(smollm2_gguf_path, tmp_path):
    table = tmp_path / "BENCHMARKS.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--max-tokens", "16", "--append", str(table)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary, last = done.stdout.strip().splitlines()[-2:]
    ratio = float(re.fullmatch(r"perplexity ratio int8/float: ([\d.]+)", last).group(1))
    agreement = float(re.search(r"next-token agreement ([\d.]+)%", summary).group(1))
    assert 0.98 < ratio < 1.02, summary
    assert agreement >= 95.0, summary
    assert "eval_quantization.py --max-tokens 16" in table.read_text()
