"""scripts/bench_kernels.py --tiny: the GPU benchmark's code path, on CPU in interpret mode."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import INTERPRETED_KERNEL_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.xla_optimised  # interpreted kernels run 1.8x slower unoptimised
def test_bench_kernels_tiny_runs(tmp_path):
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": INTERPRETED_KERNEL_XLA_FLAGS}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--tiny", "--append", str(out),
                           "--shapes", "1x32", "2x64", "--prefetch", "pages"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ratio JAX paged_attention time / ours (geometric mean over 2 configs)")
    written = out.read_text()
    assert "| 1 | 32 |" in written and "| 2 | 64 |" in written and "| 2 | 32 |" not in written
    assert "`scripts/bench_kernels.py --tiny --prefetch pages`" in written
