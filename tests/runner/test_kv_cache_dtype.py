"""The KV cache's own dtype (Engine(kv_cache_dtype=...), vLLM's --kv-cache-dtype): float8 stores saturate, every
attention implementation reads the stored values back exactly, and the engine sizes and uses such a cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.engine.steps import LogitsLog
from jaxserve.parallel.sharding import make_mesh
from jaxserve.runner import attention as attention_module
from jaxserve.runner.attention import reference_attention_fn
from jaxserve.runner.attention_impl import make_attention_fn
from jaxserve.runner.kv_cache import KVCache, cache_values, resolve_kv_cache_dtype, storage_dtype, to_cache_dtype
from tests.models.test_parity import PROMPTS
from tests.runner.test_attention_impl import CFG, decode_step, mixed_step


def test_choices_resolve_to_dtypes():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == jnp.bfloat16
    assert resolve_kv_cache_dtype("fp8", "bfloat16") == jnp.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", "float32") == jnp.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", "float32") == jnp.float8_e5m2
    assert resolve_kv_cache_dtype("bfloat16", "float32") == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2, "
                                         "got 'float16'"):
        resolve_kv_cache_dtype("float16", "float32")


def test_a_bad_kv_cache_dtype_is_refused_before_the_model_loads(monkeypatch):
    monkeypatch.setattr("jaxserve.engine.engine.open_checkpoint", lambda *a, **kw: pytest.fail("the model was opened"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*, got 'int4'"):
        Engine("any/model", kv_cache_dtype="int4")


@pytest.mark.parametrize("dtype, largest", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
def test_float8_stores_saturate_instead_of_overflowing(dtype, largest):
    x = jnp.asarray([1e6, -1e6, 500.0, 1.5, -0.25], jnp.bfloat16)
    stored = np.asarray(to_cache_dtype(x, dtype).astype(jnp.float32))
    assert np.all(np.isfinite(stored))
    assert stored[0] == largest and stored[1] == -largest and stored[3:].tolist() == [1.5, -0.25]


def as_fp8(args):
    """The cache in float8, and this step's K/V already float8 values (in float32), so that a float32 cache
    stores them unchanged too."""
    q, k, v, kv, layer, meta = args
    rounded = lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # noqa: E731
    return q, rounded(k), rounded(v), KVCache(kv.k.astype(jnp.float8_e4m3fn), kv.v.astype(jnp.float8_e4m3fn)), \
        layer, meta


@pytest.mark.parametrize("impl, decode_only", [("reference", False), ("pallas-interpret", False),
                                               ("pallas-interpret", True)])
def test_attention_reads_a_float8_cache_as_the_values_it_holds(impl, decode_only):
    """Each implementation against the reference over the same cache widened to float32 beforehand: equal to
    1e-5, so the kernels widen what they load and nothing else changes. (CPU's "reference" choice is the
    blockwise XLA loop; `reference_attention_fn` is the gather-everything ground truth.)"""
    if decode_only:
        q, k, v, kv, layer, meta = decode_step()
        args, real = (q, k, v, kv, layer, dataclasses.replace(meta, decode_only=True)), 3
    else:
        args, real = mixed_step()
    q, k, v, kv, layer, meta = as_fp8(args)
    widened = KVCache(kv.k.astype(jnp.float32), kv.v.astype(jnp.float32))
    want_out, want_kv = jax.jit(lambda *a: reference_attention_fn(*a, scale=0.125))(q, k, v, widened, layer, meta)
    stored = storage_dtype(jnp.float8_e4m3fn, "cpu", xla_attention=impl == "reference")
    assert stored == (jnp.uint8 if impl == "reference" else jnp.float8_e4m3fn)  # the engine's cache on a CPU
    kv = KVCache(*(jax.lax.bitcast_convert_type(x, stored) for x in (kv.k, kv.v)))
    fn = make_attention_fn(impl, "cpu", CFG, make_mesh(1, 1), jnp.float8_e4m3fn)
    out, new_kv = jax.jit(lambda *a: fn(*a, scale=0.125))(q, k, v, kv, layer, meta)
    assert new_kv.k.dtype == stored
    assert float(jnp.abs(out[:real] - want_out[:real]).max()) <= 1e-5
    held = [cache_values(x, jnp.float8_e4m3fn).astype(jnp.float32) for x in (new_kv.k, new_kv.v)]
    assert jnp.array_equal(held[0], want_kv.k) and jnp.array_equal(held[1], want_kv.v)


def test_only_the_xla_attention_on_a_cpu_holds_float8_as_bytes():
    """XLA:CPU's scatter into a float8 array converts the whole array (kv_cache.storage_dtype): there the cache
    holds bytes. The kernels read float8 pages themselves, and other dtypes need nothing."""
    assert storage_dtype(jnp.float8_e5m2, "cpu", xla_attention=True) == jnp.uint8
    assert storage_dtype(jnp.float8_e4m3fn, "gpu", xla_attention=True) == jnp.float8_e4m3fn
    assert storage_dtype(jnp.float8_e4m3fn, "cpu", xla_attention=False) == jnp.float8_e4m3fn
    assert storage_dtype(jnp.bfloat16, "cpu", xla_attention=True) == jnp.bfloat16
    e5m2 = jnp.asarray([1.5, -3.0, 57344.0], jnp.float8_e5m2)
    as_bytes = to_cache_dtype(e5m2.astype(jnp.float32), jnp.float8_e5m2, jnp.uint8)
    assert as_bytes.dtype == jnp.uint8 and cache_values(as_bytes, jnp.float8_e5m2).tolist() == e5m2.tolist()


def greedy_logits(engine) -> list:
    logits = LogitsLog()
    engine.observers.append(logits)
    try:
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
        return [row for _, row in logits.rows]
    finally:
        engine.observers.remove(logits)


def test_an_fp8_engine_computes_with_the_rounded_cache(tiny_checkpoint, monkeypatch):
    """The fp8 engine's logits are those of a float32 engine whose cache writes round K/V through float8 and back:
    the cache holds exactly the saturated float8 values and attention reads nothing else. And they differ from
    the plain float32 engine's, so the rounding is real."""
    path = str(tiny_checkpoint("llama", tie_word_embeddings=False))
    options = dict(num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    fp8 = Engine(path, kv_cache_dtype="fp8", **options)
    assert fp8.runner.kv_dtype == jnp.float8_e4m3fn
    assert fp8.runner.kv.k.dtype == fp8.runner.kv.v.dtype == jnp.uint8  # its bytes, on a CPU
    got = greedy_logits(fp8)
    plain = greedy_logits(Engine(path, **options))
    rounded_store = attention_module.to_cache_dtype
    monkeypatch.setattr(attention_module, "to_cache_dtype", lambda x, dtype, stored: rounded_store(
        x, jnp.float8_e4m3fn).astype(dtype))
    want = greedy_logits(Engine(path, **options))
    assert len(got) == len(want) == 3 * 5
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) <= 1e-4
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, plain)) > 1e-3


def test_the_cache_is_sized_in_its_own_dtype(tiny_checkpoint, monkeypatch):
    """The same free memory holds 4x the blocks in float8 as in float32 (less than 16 sequences fill in either)."""
    monkeypatch.setattr("jaxserve.runner.capacity.free_bytes_for_cache", lambda *args: 1 << 20)
    path = str(tiny_checkpoint("llama", tie_word_embeddings=False))
    blocks = {dtype: Engine(path, kv_cache_dtype=dtype, max_num_batched_tokens=64, max_num_seqs=16,
                            warmup=False).config.cache.num_blocks for dtype in ("auto", "fp8")}
    assert blocks["fp8"] // 4 == blocks["auto"]  # (the same bytes, a quarter of each block's, rounded down)


def test_the_triton_kernels_refuse_e4m3_below_compute_capability_8_9():
    from pallas_kernels.gpu_pages import check_gpu_cache_dtype

    with pytest.raises(ValueError, match=r"compute capability 8.9 or later .* this GPU has 8.0: use kv_cache_dtype "
                                         r"\(--kv-cache-dtype\) fp8_e5m2, or attention_impl \(--attention-impl\) "
                                         "reference"):
        check_gpu_cache_dtype(jnp.float8_e4m3fn, "8.0")
    check_gpu_cache_dtype(jnp.float8_e4m3fn, "9.0")
    check_gpu_cache_dtype(jnp.float8_e5m2, "8.0")
    check_gpu_cache_dtype(jnp.bfloat16, "8.0")


def test_the_tpu_kernels_refuse_an_fp8_cache_at_start_up():
    with pytest.raises(ValueError, match="fp8 KV cache is not supported by the TPU attention kernels yet"):
        make_attention_fn("pallas", "tpu", CFG, None, jnp.float8_e4m3fn)
    make_attention_fn("pallas-interpret", "cpu", CFG, None, jnp.float8_e4m3fn)  # the interpreter takes it
