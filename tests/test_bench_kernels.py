"""scripts/tune_decode_kernel.py and scripts/bench_kernels.py --tiny: the GPU tuning sweep's and benchmark's code
paths, on CPU in interpret mode, the benchmark run at the setting the sweep wrote (as a GPU session does)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import INTERPRETED_KERNEL_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.xla_optimised  # interpreted kernels run 1.8x slower unoptimised
def test_tune_then_bench_kernels_tiny_runs(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "XLA_FLAGS": INTERPRETED_KERNEL_XLA_FLAGS}
    best = tmp_path / "best.txt"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_decode_kernel.py"), "--tiny",
                           "--best", str(best)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "batch 2 x context 32:" and len(lines) == 6  # the shape, its 4 settings, the best
    assert lines[-1].startswith("best over 1 shapes (geometric mean): {'pages_per_block': ")
    # The best setting as bench_kernels.py flags, which that script takes back.
    flags = best.read_text().split()
    assert flags[0::2] == ["--pages-per-block", "--num-warps", "--num-stages", "--prefetch", "--target-programs"]
    assert flags[7] in ("none", "pages")

    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--tiny", "--append", str(out),
                           "--shapes", "1x32", "2x64", *flags],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ratio JAX paged_attention time / ours (geometric mean over 2 configs)")
    written = out.read_text()
    assert "| 1 | 32 |" in written and "| 2 | 64 |" in written and "| 2 | 32 |" not in written
    # the row's command names the setting it ran
    command = written.split("`scripts/bench_kernels.py ")[1].split("`")[0].split()
    assert command[0] == "--tiny" and sorted(zip(command[1::2], command[2::2])) == sorted(zip(flags[::2], flags[1::2]))
