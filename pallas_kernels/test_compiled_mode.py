"""PALLAS_COMPILED=1 (a GPU session's compiled run, pallas_kernels/testing.py) on a machine with neither a GPU nor
a TPU is refused in words, rather than collecting zero kernel tests or interpreting them silently."""

import os
import subprocess
import sys


def test_compiled_mode_without_a_gpu_or_tpu_is_refused():
    env = dict(os.environ, PALLAS_COMPILED="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import pallas_kernels.testing"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert "PALLAS_COMPILED=1 compiles the kernels for this machine's GPU or TPU, but jax sees 'cpu'" in done.stderr
