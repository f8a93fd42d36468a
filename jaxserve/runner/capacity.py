"""How many KV blocks fit, like vLLM's gpu_memory_utilization: after the weights are loaded and a profiling step
has run at the largest bucket, a fraction of device memory minus the peak in use goes to the cache. On CPU
(no device memory statistics) a share of available host memory is used instead, with no profiling step, and no
more than the engine's sequences can ever fill: host memory is the machine's, and each byte of the cache is
zero-filled at start."""

from __future__ import annotations

import psutil

from jaxserve.config import ModelConfig
from jaxserve.parallel.multihost import agree_on_min, processes_on_this_host
from jaxserve.runner.kv_cache import kv_bytes_per_block
from jaxserve.runner.plan import empty_inputs
from jaxserve.runner.sampler import SamplerFlags
from jaxserve.runner.step import StepStatics

CPU_KV_FRACTION = 0.25  # of available host memory: leaves room for weights, activations and the rest of the machine
CPU_KV_CAP_BYTES = 4 << 30


def profile_step_inputs(T: int, B: int, shape):
    """The largest step with every sampler extra on: what the cache must leave room for (`shape`: a PlanShape)."""
    inputs = empty_inputs(T, B, shape, penalties=True, constrained=True)
    flags = SamplerFlags.for_constrained(penalties=True, num_logprobs=shape.max_logprobs)
    return inputs, StepStatics(sampler=flags, prompt_logprobs=shape.max_logprobs)


def reports_memory(devices) -> bool:
    """Whether every device says how much memory it has and uses (GPUs, TPUs; not CPUs)."""
    return all(d.platform != "cpu" and "bytes_limit" in (d.memory_stats() or {}) for d in devices)


def free_bytes_for_cache(devices, memory_fraction: float, host_processes: int = 1) -> int:
    """Bytes each device can give the cache: the minimum over the devices, so they all agree on one number.

    Devices without memory statistics (CPU) share the host's memory: the host budget is split between the
    `host_processes` processes on this machine and then between each one's devices, so a mesh of 8 CPU devices
    takes the budget of one (not 8 x 4 GiB, which the kernel's out-of-memory killer ended on a 24 GiB machine),
    and two processes of a cluster tried on one machine take one budget between them."""
    if not reports_memory(devices):
        host = min(CPU_KV_FRACTION * psutil.virtual_memory().available, CPU_KV_CAP_BYTES)
        return int(host // max(1, host_processes) // max(1, len(devices)))
    per_device = []
    for d in devices:
        stats = d.memory_stats()
        in_use = max(stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0))
        per_device.append(memory_fraction * stats["bytes_limit"] - in_use)
    return int(min(per_device))


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype, free_bytes: int, shards: int = 1,
                   head_dim: int | None = None) -> int:
    """Blocks that fit in `free_bytes` per device when the cache is split `shards` ways (kv heads x layers), each
    head stored `head_dim` wide (None: the model's)."""
    per_block = kv_bytes_per_block(cfg, block_size, dtype, head_dim) / shards
    return max(2, int(free_bytes // per_block))


def capacity_line(num_blocks: int, block_size: int, max_model_len: int, kv_dtype) -> str:
    usable = num_blocks - 1  # block 0 is the null block
    tokens = usable * block_size
    return (f"# KV blocks: {usable} ({tokens} tokens in {kv_dtype}; max concurrency {tokens / max_model_len:.1f}x "
            f"at max_model_len {max_model_len})")


def blocks_to_fill(max_num_seqs: int, shape) -> int:
    """Blocks that `max_num_seqs` sequences of the longest length hold at once, and the null block: a cache any
    larger only keeps more finished prefixes."""
    return max_num_seqs * shape.max_blocks_per_seq + 1


def size_kv_cache(runner, shape, num_blocks: int | None, memory_fraction: float,
                  max_num_seqs: int, memory_bytes: int | None = None) -> tuple[int, str]:
    """Fix the number of KV blocks (None: what `memory_bytes` of each device hold, if given; else what memory
    holds, on a device that reports its memory after profiling a step at the largest bucket; on a host, at most
    what `max_num_seqs` sequences fill), the same on every process, and allocate `runner`'s cache. -> (blocks,
    how they were sized, for the log)."""
    how = "as given"
    if num_blocks is None and memory_bytes is not None:
        num_blocks = num_blocks_for(runner.cfg, runner.block_size, runner.kv_dtype, memory_bytes,
                                    shards=runner.mesh.size, head_dim=runner.cache_head_dim)
        how = f"from kv_cache_memory_bytes ({memory_bytes / 2**30:.2f} GiB a device)"
    if num_blocks is None:
        # Only a device that reports its memory use needs the profiling step's peak: on a CPU it would compile a
        # program of its own (the largest bucket with every sampler extra) for nothing, ~10 s of each start.
        # Every process runs the step if any device reports its memory: the step is a collective on a cluster.
        on_devices = agree_on_min(0 if reports_memory(runner.mesh.local_devices) else 1) == 0
        if on_devices:
            T, B = max(shape.buckets.forward_shapes())
            runner.allocate_cache(2)  # the step reads a cache: the smallest, freed for the real one below
            runner.execute(*profile_step_inputs(T, B, shape))
        sharing = 1 if on_devices else processes_on_this_host()  # a collective: every process takes this branch
        free = free_bytes_for_cache(runner.mesh.local_devices, memory_fraction, sharing)
        num_blocks = num_blocks_for(runner.cfg, runner.block_size, runner.kv_dtype, free, shards=runner.mesh.size,
                                    head_dim=runner.cache_head_dim)
        fill = blocks_to_fill(max_num_seqs, shape)
        host = "host memory" if sharing == 1 else f"host memory split between this host's {sharing} processes"
        if on_devices:
            how = "from device memory after a profiling step at the largest bucket"
        elif num_blocks > fill:
            # A tiny Llama's 4 GiB share held 170x what its 64 sequences fill, zero-filled at each start.
            num_blocks = fill
            how = f"as {max_num_seqs} sequences of {shape.max_model_len} tokens fill it (less than {host} holds)"
        else:
            how = f"from {host}"
    num_blocks = agree_on_min(num_blocks)  # across processes: all need the same cache; the fullest device decides
    if num_blocks < 2:
        raise ValueError(f"num_kv_blocks={num_blocks} is too small: block 0 is reserved, so at least 2 are needed")
    runner.allocate_cache(num_blocks)
    return num_blocks, how
