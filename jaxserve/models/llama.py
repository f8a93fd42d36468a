"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral with its sliding window, Qwen2 with q/k/v bias, Qwen3
with its q/k norms; Gemma's norms after attention and MLP, GeGLU, soft-capping and per-layer windows too).

Architecture only: weights are stacked on a leading `layers` axis and the layers run under one `lax.scan` (compile
time does not grow with depth), or, on GPU, unrolled over per-layer arrays (runner/layer_loop.py). Attention over
the paged cache is passed in (`attention_fn`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import (
    GroupedWeights,
    add_weight,
    apply_rope,
    dense,
    dequantized,
    gated_mlp,
    in_output_slices,
    lora_selection,
    param,
    rms_norm,
    rope_tables,
    soft_cap,
    weight_format,
)
from jaxserve.models.lora import add_lora_slots


class DecoderLayers(nnx.Module):
    """The weights of all L decoder layers, each stacked on a leading `layers` axis (or, unrolled, a tuple of L
    per-layer arrays: runner/layer_loop.py)."""

    def __init__(self, cfg: ModelConfig, dtype, quantization: str | GroupedWeights | None = None):
        L, D, H, K, d = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = quantization
        self.attn_norm = param((L, D), ("layers", "embed"), dtype)
        self.add_weight("wq", (L, D, H, d), ("layers", "embed", "q_heads", "head_dim"), dtype, ("embed",), q)
        self.add_weight("wk", (L, D, K, d), ("layers", "embed", "kv_heads", "head_dim"), dtype, ("embed",), q)
        self.add_weight("wv", (L, D, K, d), ("layers", "embed", "kv_heads", "head_dim"), dtype, ("embed",), q)
        self.add_weight("wo", (L, H, d, D), ("layers", "q_heads", "head_dim", "embed"), dtype,
                        ("q_heads", "head_dim"), q)
        if cfg.qkv_bias:
            self.bq = param((L, H, d), ("layers", "q_heads", "head_dim"), dtype)
            self.bk = param((L, K, d), ("layers", "kv_heads", "head_dim"), dtype)
            self.bv = param((L, K, d), ("layers", "kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.bo = param((L, D), ("layers", "embed"), dtype)
        if cfg.attention_sinks:
            self.sinks = param((L, H), ("layers", "q_heads"), dtype)
        if cfg.qk_norm:
            self.q_norm = param((L, d), ("layers", "head_dim"), dtype)
            self.k_norm = param((L, d), ("layers", "head_dim"), dtype)
        self.mlp_norm = param((L, D), ("layers", "embed"), dtype)
        if cfg.post_norms:
            self.post_attn_norm = param((L, D), ("layers", "embed"), dtype)
            self.post_mlp_norm = param((L, D), ("layers", "embed"), dtype)
        if cfg.layers_differ:  # each layer's attention kind, an index into cfg.attention_windows
            self.attn_kind = param((L,), ("layers",), jnp.int32)
        self.init_mlp(cfg, dtype, q)
        if cfg.lora_slots:
            add_lora_slots(self, cfg, dtype)

    def init_mlp(self, cfg: ModelConfig, dtype, q: str | GroupedWeights | None):
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.add_weight("w_gate", (L, D, F), ("layers", "embed", "mlp"), dtype, ("embed",), q)
        self.add_weight("w_up", (L, D, F), ("layers", "embed", "mlp"), dtype, ("embed",), q)
        self.add_weight("w_down", (L, F, D), ("layers", "mlp", "embed"), dtype, ("mlp",), q)
        if cfg.mlp_bias:
            self.b_gate = param((L, F), ("layers", "mlp"), dtype)
            self.b_up = param((L, F), ("layers", "mlp"), dtype)
            self.b_down = param((L, D), ("layers", "embed"), dtype)

    def add_weight(self, name: str, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype,
                   contract: tuple[str, ...], quantization: str | GroupedWeights | None) -> None:
        add_weight(self, name, shape, logical, dtype, contract, weight_format(quantization, name))

    def arrays(self) -> dict[str, jax.Array | tuple[jax.Array, ...]]:
        """Each weight stacked [L, ...], or as a tuple of per-layer arrays once unstacked (runner/layer_loop.py)."""
        return {name: p.get_value() for name, p in vars(self).items() if isinstance(p, nnx.Param)}


def mlp(cfg: ModelConfig, w: dict[str, jax.Array], h: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    return gated_mlp(h, w, cfg.hidden_act, adapters, **cfg.matmul)


def self_attention(cfg: ModelConfig, attention_fn, w: dict[str, jax.Array], h: jax.Array, kv, layer, meta,
                   adapters: jax.Array | None = None):
    """q/k/v projections, RoPE, paged attention, output projection. A model whose layers differ in attention
    kind passes the layer's kind on (its window, and its RoPE frequencies). `adapters`: each token's LoRA slot,
    one-hot (layers.lora_selection)."""
    kind = w.get("attn_kind")
    q = dense("TD,DHd->THd", h, w, "wq", adapters, **cfg.matmul)
    k = dense("TD,DKd->TKd", h, w, "wk", adapters, **cfg.matmul)
    v = dense("TD,DKd->TKd", h, w, "wv", adapters, **cfg.matmul)
    if cfg.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if cfg.qk_norm:  # over head_dim, each head alike (zero heads padded for tp stay zero)
        q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    inv_freqs, factors = rope_tables(cfg)
    if kind is None or isinstance(kind, int):  # one kind, or this layer's known while tracing (unrolled)
        inv_freq, factor = inv_freqs[kind or 0], float(factors[kind or 0])
    else:
        inv_freq, factor = jnp.asarray(inv_freqs)[kind], jnp.asarray(factors)[kind]
    q = apply_rope(q, meta.positions, inv_freq, factor)
    k = apply_rope(k, meta.positions, inv_freq, factor)
    sinks = {"sinks": w["sinks"]} if cfg.attention_sinks else {}
    attn, kv = attention_fn(q, k, v, kv, layer, meta, kind, **sinks)
    if cfg.quantized_activations:
        # A q head padded in for tp (zero weights, so q == 0) attends uniformly and outputs the mean of v; wo's
        # zero rows cancel it in float, but it would count in each token's activation scale: zero it.
        attn = attn * jnp.any(q != 0, axis=-1, keepdims=True).astype(attn.dtype)
    out = dense("THd,HdD->TD", attn, w, "wo", adapters, **cfg.matmul)
    return (out + w["bo"] if cfg.o_bias else out), kv


def decoder_layer(cfg: ModelConfig, attention_fn, mlp_fn, carry, w: dict[str, jax.Array], layer: jax.Array, meta):
    x, kv = carry
    eps = cfg.rms_norm_eps
    adapters = lora_selection(meta.lora_slots, w)
    out, kv = self_attention(cfg, attention_fn, w, rms_norm(x, w["attn_norm"], eps), kv, layer, meta, adapters)
    x = x + _residual(cfg, out, w.get("post_attn_norm"))
    out = mlp_fn(cfg, w, rms_norm(x, w["mlp_norm"], eps), adapters)
    x = x + _residual(cfg, out, w.get("post_mlp_norm"))
    return x, kv


def _residual(cfg: ModelConfig, out: jax.Array, post_norm: jax.Array | None) -> jax.Array:
    """What a block adds to the residual stream: its output, normed after (Gemma 2/3) or scaled (Granite)."""
    if cfg.post_norms:
        out = rms_norm(out, post_norm, cfg.rms_norm_eps)
    return out if cfg.residual_multiplier == 1.0 else out * cfg.residual_multiplier


def scan_layers(layer_fn, weights: dict[str, jax.Array], x: jax.Array, kv, meta):
    """Run the layers stacked in `weights` one after another (one `lax.scan`); the cache's layer i is weight
    i's. The pipeline (parallel/pipeline.py) runs the same function on each stage's own layers."""
    num_layers = jax.tree.leaves(weights)[0].shape[0]

    def body(carry, xs):
        w, layer = xs
        return layer_fn(carry, w, layer, meta), None

    (x, kv), _ = jax.lax.scan(body, (x, kv), (weights, jnp.arange(num_layers)))
    return x, kv


class LlamaForCausalLM(nnx.Module):
    layers_class = DecoderLayers
    mlp_fn = staticmethod(mlp)

    def __init__(self, cfg: ModelConfig, dtype, quantization: str | GroupedWeights | None = None):
        """`quantization="int8"`: the decoder layers' matmul weights are int8. The embedding and LM head stay in
        `dtype`, as in GPTQ/AWQ checkpoints: the logits are the most quantization-sensitive output, and on CPU
        XLA would convert the whole int8 vocabulary matrix to float every step (it does not fuse that convert).
        "w8a8": the same weights, multiplied by int8 activations (layers.quantized_matmul). `GroupedWeights`: the
        weights it names (the embedding and LM head too) kept in their checkpoint's blocks (a GGUF's)."""
        self.cfg = dataclasses.replace(cfg, quantized_activations="int8") if quantization == "w8a8" else cfg
        V, D = cfg.vocab_size + cfg.vocab_pad, cfg.hidden_size
        stored = partial(weight_format, quantization, quantized_by_name=False)
        add_weight(self, "embed", (V, D), ("vocab", "embed"), dtype, ("embed",), stored("embed"))
        self.layers = self.layers_class(cfg, dtype, quantization)
        self.final_norm = param((D,), ("embed",), dtype)
        if not cfg.tie_word_embeddings:
            add_weight(self, "lm_head", (D, V), ("embed", "vocab"), dtype, ("embed",), stored("lm_head"))

    def __call__(self, token_ids: jax.Array, kv, meta, attention_fn, run_layers=scan_layers, experts_fn=None):
        """Hidden states [T, D] after the final norm, and the updated cache. `run_layers` runs the layers: a
        plain scan, the unrolled loop over per-layer arrays (runner/layer_loop.py), or the pipeline over stages.
        `experts_fn`: how a mixture of experts runs its chosen experts on the mesh (runner/experts_impl.py).
        `kv` and `meta` reach `run_layers` untouched (a pipeline tick carries its activations beside the cache)."""
        x = self.embed_tokens(token_ids)
        mlp_fn = self.mlp_fn if experts_fn is None else partial(self.mlp_fn, experts_fn=experts_fn)
        layer_fn = partial(decoder_layer, self.cfg, attention_fn, mlp_fn)
        x, kv = run_layers(layer_fn, self.layers.arrays(), x, kv, meta)
        return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps), kv

    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        if not hasattr(self, "embed_scale"):
            return self.embed[...][token_ids]
        rows = {name: getattr(self, name)[...][token_ids] for name in ("embed", "embed_scale", "embed_offset")
                if hasattr(self, name)}  # a grouped embedding's rows, dequantized alone
        return dequantized(rows, "embed", self.final_norm[...].dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [N, V] for the N hidden states asked for (only the sampled positions)."""
        name = "embed" if self.cfg.tie_word_embeddings else "lm_head"
        stored = {n: getattr(self, n)[...] for n in (name, name + "_scale", name + "_offset") if hasattr(self, n)}
        spec = "ND,VD->NV" if self.cfg.tie_word_embeddings else "ND,DV->NV"

        def matmul(part: dict[str, jax.Array]) -> jax.Array:
            return jnp.einsum(spec, hidden, dequantized(part, name, hidden.dtype), preferred_element_type=jnp.float32)

        out = in_output_slices(spec, stored, name, hidden.dtype, self.cfg.dequantize_slice_bytes, matmul)
        return soft_cap(out[:, : self.cfg.vocab_size], self.cfg.final_logit_softcap)  # padded rows are not tokens
