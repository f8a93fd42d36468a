"""The Pallas paged-attention kernels behind the engine's attention interface.

Decode-only steps (`meta.decode_only`) run the decode kernel, one query per sequence; every other step runs the
ragged kernel, for which the step's per-token metadata (AttentionMetadata) becomes the kernel's per-sequence
description (q_start, q_lens, kv_lens). On a mesh with tensor parallelism the kernel runs under `shard_map` over heads, each
device attending with its own q heads and its own kv heads' slice of the cache.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.parallel.sharding import mesh_axes, nested_map_mesh, partition_spec
from jaxserve.runner.attention import AttentionMetadata, write_kv
from jaxserve.runner.kv_cache import KVCache
from jaxserve.runner.paged_attention_xla import blockwise_paged_attention
from pallas_kernels.paged_attention import DECODE_KERNELS
from pallas_kernels.ragged_attention import RAGGED_KERNELS

# The cache's logical axes inside a map over heads: only kv heads are split (layers stay whole there).
CACHE_HEAD_AXES = (None, "kv_heads", None, None, "head_dim")


def ragged_metadata(meta: AttentionMetadata, block_size: int):
    """(q_start, q_lens, kv_lens), each [B], from the per-token metadata.

    Padding tokens are the ones that write into the null block (slot < block_size); they belong to no sequence.
    A sequence's tokens are contiguous in T and in position order, so its first token, its token count and its
    last position + 1 describe it. Rows with no token (batch padding) get zeros.
    """
    T, B = meta.positions.shape[0], meta.block_tables.shape[0]
    real = meta.slot_mapping >= block_size
    seg = jnp.where(real, meta.token_seq, B)  # padding goes to an extra segment, dropped below
    q_lens = jax.ops.segment_sum(real.astype(jnp.int32), seg, num_segments=B + 1)[:B]
    q_start = jax.ops.segment_min(jnp.arange(T, dtype=jnp.int32), seg, num_segments=B + 1)[:B]
    kv_lens = jax.ops.segment_max(meta.positions + 1, seg, num_segments=B + 1)[:B]
    has = q_lens > 0
    return jnp.where(has, q_start, 0), q_lens, jnp.where(has, kv_lens, 0).astype(jnp.int32)


def _kernel_call(q, kv: KVCache, meta: AttentionMetadata, layer, *, window, scale, softcap, backend, interpret,
                 sinks=None):
    """The kernel's output for a step whose K/V are in the cache already (read-only on the cache).

    Attention sinks (gpt-oss: each head's logit that joins the softmax's denominator and attends to nothing):
    the GPU kernels return their log-sum-exp, so their output is rescaled by sigmoid(lse - sink), the share the
    keys keep beside the sink. The TPU kernels return none: there the XLA attention runs."""
    kw = dict(layer=layer, scale=scale, sliding_window=window, softcap=softcap, interpret=interpret)
    if sinks is not None:
        if backend != "gpu":
            return blockwise_paged_attention(q, kv.k, kv.v, layer, meta, scale=scale, sliding_window=window,
                                             softcap=softcap, sinks=sinks)
        kw["return_lse"] = True
    if meta.decode_only:  # token i is row i's only token: the decode kernel (one query per sequence)
        assert q.shape[0] == meta.block_tables.shape[0], (q.shape, meta.block_tables.shape)
        context_lens = jnp.where(meta.slot_mapping >= kv.block_size, meta.positions + 1, 0)  # padding rows: 0
        out = DECODE_KERNELS[backend](q, kv.k, kv.v, meta.block_tables, context_lens, **kw)
    else:
        q_start, q_lens, kv_lens = ragged_metadata(meta, kv.block_size)
        out = RAGGED_KERNELS[backend](q, kv.k, kv.v, meta.block_tables, q_start, q_lens, kv_lens, **kw)
    if sinks is None:
        return out
    out, lse = out
    kept = jax.nn.sigmoid(lse - sinks.astype(jnp.float32)[None, :])  # e^lse / (e^lse + e^sink)
    return (out.astype(jnp.float32) * kept[..., None]).astype(q.dtype)


def pad_heads(x: jax.Array, size: int) -> jax.Array:
    """[T, heads, d] -> [T, heads, size], zeros after d: the cache's head size (attention_impl.cache_head_dim)."""
    d = x.shape[-1]
    return x if d == size else jnp.pad(x, ((0, 0), (0, 0), (0, size - d)))


def _attend(q, k, v, kv: KVCache, layer, meta: AttentionMetadata, kind=None, *, scale, windows=(None,),
            softcap=None, backend, interpret, sinks=None):
    # A head size the kernel cannot tile runs padded with zeros to the cache's (q.k and the kept output dims are
    # unchanged; `scale` is the model's own).
    d, stored = q.shape[-1], kv.k.shape[-1]
    q, k, v = (pad_heads(x, stored) for x in (q, k, v))
    kv = write_kv(kv, layer, k, v, meta.slot_mapping)
    call = partial(_kernel_call, q, kv, meta, layer, scale=scale, softcap=softcap, backend=backend,
                   interpret=interpret, sinks=sinks)
    if kind is None or isinstance(kind, int):  # one kind, or this layer's known while tracing (unrolled)
        return call(window=windows[kind or 0])[..., :d], kv
    # Layers of several kinds (Gemma) under a scan: the window is a compile-time constant of the kernel, so each
    # kind has its own, and the layer's kind picks one at run time. The cache write stays outside, so the
    # branches only read.
    return jax.lax.switch(kind, [partial(call, window=w) for w in windows])[..., :d], kv


def pallas_attention_fn(backend: str, interpret: bool, mesh: Mesh | None):
    """An attention fn with reference_attention_fn's signature, running the `backend` ("gpu"/"tpu") kernel."""
    attend = partial(_attend, backend=backend, interpret=interpret)
    if mesh is None or mesh.size == 1:
        return attend

    # Compiled kernels need only the head axis manual; the interpreters' callbacks need every mesh axis manual.
    axes = frozenset(mesh.axis_names) if interpret else mesh_axes(CACHE_HEAD_AXES)

    def sharded(q, k, v, kv, layer, meta, kind=None, *, scale, windows=(None,), softcap=None, sinks=None):
        heads, kv_heads = partition_spec((None, "q_heads", None)), partition_spec((None, "kv_heads", None))
        cache = KVCache(partition_spec(CACHE_HEAD_AXES), partition_spec(CACHE_HEAD_AXES))
        everywhere = partition_spec(())
        body = partial(attend, scale=scale, windows=windows, softcap=softcap)
        args, specs = (q, k, v, kv, layer, meta), (heads, kv_heads, kv_heads, cache, everywhere, everywhere)
        if isinstance(kind, int):  # static: bound into the body, not mapped
            body = partial(body, kind=kind)
        elif kind is not None:
            args, specs = args + (kind,), specs + (everywhere,)
        if sinks is not None:  # each device's own q heads' sinks, passed last
            with_sinks = body
            body = lambda *a: with_sinks(*a[:-1], sinks=a[-1])  # noqa: E731
            args, specs = args + (sinks,), specs + (partition_spec(("q_heads",)),)
        outer, manual = nested_map_mesh(mesh)  # inside a pipeline stage, pp is manual already
        # check_vma=False: pallas_call has no replication rule; the kernel is purely per-device anyway.
        return jax.shard_map(body, mesh=outer, in_specs=specs, out_specs=(heads, cache), axis_names=axes - manual,
                             check_vma=False)(*args)

    return sharded
