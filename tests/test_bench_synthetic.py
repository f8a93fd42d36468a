"""scripts/bench_synthetic.py refuses bad options in one line (its figures: tests/test_gpu_session.py)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_synthetic.py"


def test_bench_synthetic_refuses_bad_lengths():
    done = subprocess.run([sys.executable, str(SCRIPT), "--decode-lens", "8", "8"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--decode-lens needs 0 < SHORT < LONG, got 8 8" in done.stderr
