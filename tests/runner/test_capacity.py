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
    takes the one host budget (here 1/4 of a pretended 128 MiB available, less than its 64 sequences could fill), not
    a budget per device. The tiny Llama's 2 kv heads are replicated over tp=4, so the devices hold copies: it is the
    bytes held that must fit."""
    from jaxserve import Engine, SamplingParams

    available = 128 << 20
    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=available))
    budget = min(capacity.CPU_KV_FRACTION * available, capacity.CPU_KV_CAP_BYTES)
    engine = Engine(str(tiny_checkpoint("llama")), mesh="4x2", warmup=False)
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(engine.runner.kv) for shard in leaf.addressable_shards)
    assert 0.9 * budget <= held <= budget, (held, budget)
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


class _Device:
    def __init__(self, platform: str, stats: dict | None):
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        return self._stats


class _Runner:
    """What size_kv_cache uses of a ModelRunner, recording the steps it runs and the caches it allocates."""

    def __init__(self, devices):
        from jaxserve.config import ModelConfig

        self.mesh = types.SimpleNamespace(local_devices=devices, size=len(devices))
        self.cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
        self.block_size, self.kv_dtype, self.cache_head_dim = 16, "float32", None
        self.executed, self.allocated = [], []

    def allocate_cache(self, blocks):
        self.allocated.append(blocks)

    def execute(self, inputs, statics):
        self.executed.append((inputs.token_ids.shape, statics))


def test_only_a_device_that_reports_its_memory_runs_the_profiling_step(monkeypatch):
    """On a GPU the largest step's peak is what the cache must leave room for; a CPU sizes from host memory, and a
    profiling step there compiled a program of its own for nothing (~10 s of each start)."""
    from jaxserve.runner.buckets import Buckets
    from jaxserve.runner.plan import PlanShape

    shape = PlanShape(Buckets.for_limits(64, 4), 16, 32, 256, 5)
    per_block = 2 * 2 * 1 * 32 * 4 * 16  # K and V, 2 layers, 1 kv head of 32 float32 values, 16 tokens
    gpu = _Runner([_Device("gpu", {"bytes_limit": 1000 * per_block, "peak_bytes_in_use": 500 * per_block})])
    blocks, how = capacity.size_kv_cache(gpu, shape, None, 0.9, max_num_seqs=100)
    assert blocks == 400 and gpu.allocated == [2, 400] and "profiling step" in how  # 0.9 x 1000 - 500 blocks
    assert len(gpu.executed) == 1 and gpu.executed[0][0] == (64,) and gpu.executed[0][1].sampler.penalties

    monkeypatch.setattr(capacity.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=4000 * per_block))
    cpu = _Runner([_Device("cpu", None)])
    blocks, how = capacity.size_kv_cache(cpu, shape, None, 0.9, max_num_seqs=100)
    assert blocks == 1000 and cpu.executed == [] and how == "from host memory"  # a quarter of what is available
    assert capacity.size_kv_cache(cpu, shape, 7, 0.9, max_num_seqs=100) == (7, "as given")
    # Fewer sequences than that fills: each holds at most 256 / 16 blocks, and block 0 is the null block.
    blocks, how = capacity.size_kv_cache(cpu, shape, None, 0.9, max_num_seqs=4)
    assert blocks == 4 * 16 + 1 and how.startswith("as 4 sequences of 256 tokens fill it")
    # A GPU's cache is all its memory fraction gives, as vLLM's is: the cap is the host's.
    assert capacity.size_kv_cache(gpu, shape, None, 0.9, max_num_seqs=4)[0] == 400

    # Two processes of a cluster on this one host: each takes half the host's budget.
    monkeypatch.setattr(capacity, "processes_on_this_host", lambda: 2)
    blocks, how = capacity.size_kv_cache(cpu, shape, None, 0.9, max_num_seqs=100)
    assert blocks == 500 and how == "from host memory split between this host's 2 processes"
