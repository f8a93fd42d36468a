"""The CPU cache budget belongs to the host, not to each fake device: a mesh of 8 CPU devices shares one."""

import types

import jax

from jaxserve.runner import capacity


def test_cpu_devices_split_one_host_budget(monkeypatch):
    available = 10 << 30
    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    one = capacity.free_bytes_for_cache(jax.devices()[:1], 0.9)
    assert one == min(capacity.CPU_KV_FRACTION * available, capacity.CPU_KV_CAP_BYTES)
    eight = capacity.free_bytes_for_cache(jax.devices()[:8], 0.9)
    assert eight == one // 8  # 8 x 4 GiB of a 24 GiB host was what the kernel killed
