"""Engine-side attention selection and the Pallas adapter: a padded mixed step (prefill chunks, a decode, padding
tokens and an empty batch row, as runner/plan.py builds them) gives the reference's outputs and cache."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.parallel.sharding import make_mesh
from jaxserve.runner.attention import AttentionMetadata, reference_attention_fn
from jaxserve.runner.attention_impl import cache_head_dim, make_attention_fn
from jaxserve.runner.kv_cache import KVCache
from jaxserve.runner.paged_attention_xla import blockwise_attention_fn
from jaxserve.runner.pallas_attention import ragged_metadata

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
BS = 8


def mixed_step(T=16, B=4, L=2, NB=20, cfg=CFG):
    """Row 0: a 5-token prefill from 0; row 1: a decode at position 20; row 2: a chunk of 7 from 16; row 3: empty."""
    rng = np.random.default_rng(0)
    chunks = [(0, 5), (20, 1), (16, 7)]
    pages = rng.permutation(np.arange(1, NB))
    tables = np.zeros((B, 4), np.int32)
    tables[:3] = pages[:12].reshape(3, 4)
    positions, slots, token_seq = (np.zeros(T, np.int32) for _ in range(3))
    t = 0
    for row, (start, n) in enumerate(chunks):
        pos = np.arange(start, start + n)
        positions[t : t + n], token_seq[t : t + n] = pos, row
        slots[t : t + n] = tables[row, pos // BS] * BS + pos % BS
        t += n
    meta = AttentionMetadata(*map(jnp.asarray, (positions, slots, token_seq, tables)))
    keys = jax.random.split(jax.random.key(1), 5)
    K, H, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    kv = KVCache(jax.random.normal(keys[0], (L, K, NB, BS, d)), jax.random.normal(keys[1], (L, K, NB, BS, d)))
    q, k, v = (jax.random.normal(key, (T, n, d)) for key, n in zip(keys[2:], (H, K, K)))
    return (q, k, v, kv, jnp.int32(1), meta), t


def run(fn, args):
    # float32 matmuls in full: a GPU's default (TF32 / bf16 passes) put the reference 2e-3 off when this file ran
    # there under PALLAS_COMPILED=1 (2026-11-28, H100), and these tests compare to 1e-5
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda *a: fn(*a, scale=0.125))(*args)


def test_ragged_metadata_skips_padding():
    (_, _, _, _, _, meta), _ = mixed_step()
    q_start, q_lens, kv_lens = ragged_metadata(meta, BS)
    assert q_start.tolist() == [0, 5, 6, 0] and q_lens.tolist() == [5, 1, 7, 0] and kv_lens.tolist() == [5, 21, 23, 0]


@pytest.mark.parametrize("tp", [1, 2])
def test_pallas_interpret_matches_reference(tp):
    args, real = mixed_step()
    want_out, want_kv = run(reference_attention_fn, args)
    fn = make_attention_fn("pallas-interpret", "cpu", CFG, make_mesh(tp, 1))
    out, kv = run(fn, args)
    assert float(jnp.abs(out[:real] - want_out[:real]).max()) <= 1e-5
    assert jnp.array_equal(kv.k, want_kv.k) and jnp.array_equal(kv.v, want_kv.v)


@pytest.mark.parametrize("head_dim", [24, 80, 96, 256])
def test_a_head_size_the_kernels_cannot_tile_is_attended_padded(head_dim):
    """The adapter pads q, K and V with zeros to the cache's width (cache_head_dim) and cuts the output back: the
    reference's output, and its cache in the first head_dim dims with zeros after."""
    cfg = dataclasses.replace(CFG, head_dim=head_dim)
    (q, k, v, kv, layer, meta), real = mixed_step(cfg=cfg)
    want_out, want_kv = run(reference_attention_fn, (q, k, v, kv, layer, meta))
    stored = cache_head_dim("pallas-interpret", "cpu", cfg)
    wide = KVCache(*(jnp.pad(x, [(0, 0)] * 4 + [(0, stored - head_dim)]) for x in (kv.k, kv.v)))
    out, kv = run(make_attention_fn("pallas-interpret", "cpu", cfg), (q, k, v, wide, layer, meta))
    assert out.shape == want_out.shape and float(jnp.abs(out[:real] - want_out[:real]).max()) <= 1e-5
    assert jnp.array_equal(kv.k[..., :head_dim], want_kv.k) and jnp.array_equal(kv.v[..., :head_dim], want_kv.v)
    assert not jnp.any(kv.k[..., head_dim:]) and not jnp.any(kv.v[..., head_dim:])


def decode_step(B=4, L=2, NB=20):
    """Rows 0-2 decode one token each (positions 20, 0 and 15: a full block, a first token, a block's last slot);
    row 3 is batch padding. Token i is row i's, as plan.py lays decode-only steps out."""
    rng = np.random.default_rng(2)
    tables = np.zeros((B, 4), np.int32)
    tables[:3] = rng.permutation(np.arange(1, NB))[:12].reshape(3, 4)
    positions = np.array([20, 0, 15, 0], np.int32)
    slots = np.where(np.arange(B) < 3, tables[np.arange(B), positions // BS] * BS + positions % BS, 0).astype(np.int32)
    meta = AttentionMetadata(*map(jnp.asarray, (positions, slots, np.arange(B, dtype=np.int32), tables)))
    keys = jax.random.split(jax.random.key(3), 5)
    K, H, d = CFG.num_kv_heads, CFG.num_heads, CFG.head_dim
    kv = KVCache(jax.random.normal(keys[0], (L, K, NB, BS, d)), jax.random.normal(keys[1], (L, K, NB, BS, d)))
    q, k, v = (jax.random.normal(key, (B, n, d)) for key, n in zip(keys[2:], (H, K, K)))
    return q, k, v, kv, jnp.int32(0), meta


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_only_steps_run_the_decode_kernel_and_match_the_reference(tp, monkeypatch):
    from pallas_kernels.paged_attention import DECODE_KERNELS

    args = decode_step()
    want_out, want_kv = run(reference_attention_fn, args)
    traced, kernel = [], DECODE_KERNELS["gpu"]
    monkeypatch.setitem(DECODE_KERNELS, "gpu", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    q, k, v, kv, layer, meta = args
    decode_meta = dataclasses.replace(meta, decode_only=True)
    out, kv = run(make_attention_fn("pallas-interpret", "cpu", CFG, make_mesh(tp, 1)), (q, k, v, kv, layer, decode_meta))
    assert traced
    assert float(jnp.abs(out[:3] - want_out[:3]).max()) <= 1e-5
    assert jnp.array_equal(kv.k, want_kv.k) and jnp.array_equal(kv.v, want_kv.v)


WINDOWS = (None, 6)  # kind 0 attends to everything, kind 1 through a window of 6


@pytest.mark.parametrize("impl, tp, decode_only, static_kind", [
    ("reference", 1, False, False), ("pallas-interpret", 2, False, False), ("pallas-interpret", 1, True, False),
    ("reference", 1, False, True), ("pallas-interpret", 2, False, True), ("pallas-interpret", 1, True, True)])
def test_each_layer_kind_attends_with_its_window_and_the_soft_cap(impl, tp, decode_only, static_kind, monkeypatch):
    """Gemma's layers: under a scan the layer's kind is a traced value (one compiled layer body for every layer)
    that picks its window at run time; unrolled, it is a Python int and only that kind's attention is built (no
    lax.switch). Gemma 2's soft cap applies to the scores. Checked against the reference given that window as a
    constant, for both kinds, which must differ (row 1 sees 21 keys, 6 through the window)."""
    if static_kind:
        monkeypatch.setattr(jax.lax, "switch", lambda *a, **kw: pytest.fail("a static kind went through switch"))
    if decode_only:
        q, k, v, kv, layer, meta = decode_step()
        args, real = (q, k, v, kv, layer, dataclasses.replace(meta, decode_only=True)), 3
    else:
        args, real = mixed_step()
    fn = make_attention_fn(impl, "cpu", CFG, make_mesh(tp, 1))
    by_kind = jax.jit(lambda kind, *a: fn(*a, kind, scale=0.125, windows=WINDOWS, softcap=2.0),
                      static_argnums=0 if static_kind else ())
    outs = []
    for kind, window in enumerate(WINDOWS):
        want_out, want_kv = jax.jit(lambda *a, window=window: reference_attention_fn(*a, scale=0.125, windows=(window,),
                                                                      softcap=2.0))(*args)
        out, kv = by_kind(kind if static_kind else jnp.int32(kind), *args)
        assert float(jnp.abs(out[:real] - want_out[:real]).max()) <= 1e-5
        assert jnp.array_equal(kv.k, want_kv.k) and jnp.array_equal(kv.v, want_kv.v)
        outs.append(out[:real])
    uncapped, _ = run(reference_attention_fn, args)
    assert float(jnp.abs(outs[0] - outs[1]).max()) > 1e-2, "the window made no difference"
    assert float(jnp.abs(outs[0] - uncapped[:real]).max()) > 1e-2, "the soft cap made no difference"


def test_choice_of_implementation():
    assert make_attention_fn("auto", "cpu", CFG) is blockwise_attention_fn
    assert make_attention_fn("reference", "gpu", CFG) is blockwise_attention_fn
    assert make_attention_fn("auto", "gpu", CFG) is not blockwise_attention_fn
    with pytest.raises(ValueError, match="'flash'.*'auto', 'reference', 'pallas', 'pallas-interpret'"):
        make_attention_fn("flash", "cpu", CFG)
    with pytest.raises(ValueError, match="needs a GPU or TPU"):
        make_attention_fn("pallas", "cpu", CFG)


@pytest.mark.parametrize("device_kind, listed", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA L40S", False)])
def test_a_gpu_the_triton_backend_does_not_list_gets_the_xla_attention(monkeypatch, caplog, device_kind, listed):
    """From jax 0.11, Pallas's Triton lowering looks the GPU up by name (`pallas.triton.get_gpu_info`) and refuses,
    inside the first compile, one it does not list: "auto" then takes the XLA attention and says so, "pallas" is
    refused at start naming the GPU. Played on this CPU with that lookup, as jax 0.11 has it."""
    from jax.experimental.pallas import triton as plgpu

    def get_gpu_info():
        if not listed:
            raise ValueError(f"Unsupported GPU device kind: {device_kind}")

    monkeypatch.setattr(plgpu, "get_gpu_info", get_gpu_info, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [types.SimpleNamespace(device_kind=device_kind)])
    assert (make_attention_fn("auto", "gpu", CFG) is not blockwise_attention_fn) == listed
    assert cache_head_dim("auto", "gpu", head_dim_config(96)) == (128 if listed else 96)
    if listed:
        assert make_attention_fn("pallas", "gpu", CFG) is not blockwise_attention_fn
    else:
        assert f"does not know this GPU, {device_kind} (jax " in caplog.text
        with pytest.raises(ValueError, match=f"cannot compile the attention kernels for this GPU, {device_kind}"):
            make_attention_fn("pallas", "gpu", CFG)
    assert make_attention_fn("pallas-interpret", "gpu", CFG) is not blockwise_attention_fn  # no Triton lowering


def head_dim_config(head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=96, intermediate_size=64,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim)


@pytest.mark.parametrize("head_dim, stored", [(96, 128), (24, 32), (8, 16), (64, 64), (256, 256)])
def test_the_triton_kernels_take_any_head_size_stored_padded(head_dim, stored):
    cfg = head_dim_config(head_dim)
    assert make_attention_fn("auto", "gpu", cfg) is not blockwise_attention_fn
    assert cache_head_dim("auto", "gpu", cfg) == stored
    assert cache_head_dim("reference", "gpu", cfg) == cache_head_dim("auto", "cpu", cfg) == head_dim
    assert cache_head_dim("pallas-interpret", "cpu", cfg) == stored  # the interpreter runs the Triton kernel
    assert cache_head_dim("auto", "tpu", cfg) == head_dim  # the TPU kernel takes the model's own


def test_auto_falls_back_where_the_triton_kernel_cannot_tile():
    wide = head_dim_config(320)
    assert make_attention_fn("auto", "gpu", wide) is blockwise_attention_fn
    assert cache_head_dim("auto", "gpu", wide) == 320
    with pytest.raises(ValueError, match="tile heads of at most 256, and this model's head_dim is 320"):
        make_attention_fn("pallas", "gpu", wide)
