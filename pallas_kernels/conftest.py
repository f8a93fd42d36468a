"""Kernel tests run on the host CPU (interpret mode), with 8 fake devices for the shard_map test; with
PALLAS_COMPILED=1 (pallas_kernels/testing.py) on the machine's GPU or TPU. Set before jax is imported, as
tests/conftest.py does for the rest of the suite."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("PALLAS_COMPILED") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
