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


def test_default_cache_on_an_8_device_mesh_fills_the_host_budget_once(monkeypatch, tiny_checkpoint):
    """Engine(mesh="4x2") with the default KV sizing, as a user builds it: the cache over all 8 CPU devices together
    takes the one host budget (here 1/4 of a pretended 2 GiB available), not a budget per device. The tiny Llama's
    2 kv heads are replicated over tp=4, so the devices hold copies: it is the bytes held that must fit."""
    from jaxserve import Engine, SamplingParams

    available = 2 << 30
    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    budget = min(capacity.CPU_KV_FRACTION * available, capacity.CPU_KV_CAP_BYTES)
    engine = Engine(str(tiny_checkpoint("llama")), mesh="4x2", warmup=False)
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(engine.runner.kv) for shard in leaf.addressable_shards)
    assert 0.9 * budget <= held <= budget, (held, budget)
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
