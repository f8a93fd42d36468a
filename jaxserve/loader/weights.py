"""Hugging Face tensor names and layouts -> this package's stacked parameter layout.

Every checkpoint format (safetensors, GGUF) is first presented as a `TensorSource` under HF names with HF
(PyTorch) layouts, so this mapping is written once. Layer weights are stacked on a leading `layers` axis.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.grouped import GroupedArray, common_format, stack_grouped
from jaxserve.models.layers import Grouped, GroupedWeights

log = logging.getLogger(__name__)


class TensorSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> np.ndarray: ...


class BlockSource(TensorSource, Protocol):
    """A source whose quantized tensors can stay in their blocks (a GGUF file, a compressed-tensors checkpoint)."""

    method: str  # the engine's quantization that keeps them: "gguf", "compressed-tensors", "fp8"
    # Optional (read with getattr, default False): the kept values are float8 or float4 (FP8, MXFP4), which a CPU
    # dequantizes at load by default (runner/weights.resolve_quantization).
    float_values: bool

    def block_format(self, name: str) -> Grouped | None: ...

    def get_grouped(self, name: str) -> GroupedArray: ...


class RenamingSource:
    """Base of a source presenting another's tensors under other names (`_source` beneath): what the engine asks of
    a quantized checkpoint as a whole (its method, whether its activations are quantized, whether its values are
    floats) is the one beneath's."""

    _source: TensorSource

    @property
    def method(self) -> str | None:
        return getattr(self._source, "method", None)

    @property
    def activations(self) -> str | None:
        return getattr(self._source, "activations", None)

    @property
    def float_values(self) -> bool:
        return getattr(self._source, "float_values", False)


ParamPath = tuple[str, ...]


def _norm_gain(cfg: ModelConfig) -> Callable[[np.ndarray], np.ndarray]:
    """RMSNorm gains as our norm multiplies by them: Gemma's checkpoints hold w for a gain of 1 + w."""
    offset = cfg.norm_weight_offset
    return (lambda w: w) if not offset else (lambda w: w.astype(np.float32) + offset)


def _layer_weights(cfg: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    """Our stacked name -> (HF name inside layer i, transform from HF layout to ours)."""
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = _norm_gain(cfg)
    table = {
        "attn_norm": ("input_layernorm.weight", norm),
        "wq": ("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, d)),
        "wk": ("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, d)),
        "wv": ("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, d)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, d, D)),
        "mlp_norm": ("post_attention_layernorm.weight", norm),
    }
    if cfg.post_norms:  # Gemma 2/3: post_attention_layernorm follows attention; the MLP has a norm each side
        table |= {
            "post_attn_norm": ("post_attention_layernorm.weight", norm),
            "mlp_norm": ("pre_feedforward_layernorm.weight", norm),
            "post_mlp_norm": ("post_feedforward_layernorm.weight", norm),
        }
    if cfg.qkv_bias:
        table |= {
            "bq": ("self_attn.q_proj.bias", lambda b: b.reshape(H, d)),
            "bk": ("self_attn.k_proj.bias", lambda b: b.reshape(K, d)),
            "bv": ("self_attn.v_proj.bias", lambda b: b.reshape(K, d)),
        }
    if cfg.qk_norm:
        table |= {
            "q_norm": ("self_attn.q_norm.weight", norm),
            "k_norm": ("self_attn.k_norm.weight", norm),
        }
    if cfg.o_bias:
        table["bo"] = ("self_attn.o_proj.bias", lambda b: b)
    if cfg.attention_sinks:
        table["sinks"] = ("self_attn.sinks", lambda s: s)
    if cfg.architecture in STACKED_EXPERTS:
        table |= STACKED_EXPERTS[cfg.architecture]
    elif cfg.num_experts:
        table |= {
            "router": (f"{moe_names(cfg)[0]}.gate.weight", lambda w: w.T),
        }
    else:
        table |= {
            "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
            "w_up": ("mlp.up_proj.weight", lambda w: w.T),
            "w_down": ("mlp.down_proj.weight", lambda w: w.T),
        }
    if cfg.mlp_bias:
        table |= {
            "b_gate": ("mlp.gate_proj.bias", lambda b: b),
            "b_up": ("mlp.up_proj.bias", lambda b: b),
            "b_down": ("mlp.down_proj.bias", lambda b: b),
        }
    if cfg.shared_expert_size:
        table |= {
            "shared_gate": ("mlp.shared_expert.gate_proj.weight", lambda w: w.T),
            "shared_up": ("mlp.shared_expert.up_proj.weight", lambda w: w.T),
            "shared_down": ("mlp.shared_expert.down_proj.weight", lambda w: w.T),
            # [1, D] in HF files, [D] in GGUF ones
            "shared_expert_gate": ("mlp.shared_expert_gate.weight", lambda w: w.reshape(1, -1).T),
        }
    return table


# Where each architecture keeps its router (`{block}.gate`) and experts (`{block}.experts.{e}.{name}`): Mixtral
# names the expert matrices w1 (gate), w3 (up), w2 (down). Ours are stacked [L, E, ...].
MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}),
    "Qwen2MoeForCausalLM": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
    "Qwen3MoeForCausalLM": ("mlp", {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}),
}


# Experts a checkpoint already stacks per layer, [E, in, out] (gpt-oss: gate and up in one tensor, alternating
# column by column), and the router with its bias. Read like any layer weight, then stacked over layers.
STACKED_EXPERTS = {
    "GptOssForCausalLM": {
        "router": ("mlp.router.weight", lambda w: w.T),
        "router_bias": ("mlp.router.bias", lambda b: b),
        "w_gate": ("mlp.experts.gate_up_proj", lambda w: w[..., ::2]),
        "w_up": ("mlp.experts.gate_up_proj", lambda w: w[..., 1::2]),
        "w_down": ("mlp.experts.down_proj", lambda w: w),
        "b_gate": ("mlp.experts.gate_up_proj_bias", lambda b: b[..., ::2]),
        "b_up": ("mlp.experts.gate_up_proj_bias", lambda b: b[..., 1::2]),
        "b_down": ("mlp.experts.down_proj_bias", lambda b: b),
    },
}


def moe_names(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    return MOE_NAMES[cfg.architecture]


def fill(template: str, index: tuple[int, ...]) -> str:
    """The name `template` with its `*`s replaced by `index`: ("model.layers.*.w", (3,)) -> "model.layers.3.w"."""
    for i in index:
        template = template.replace("*", str(i), 1)
    return template


# A stacked tensor's maker: (HF name template with a `*` per counted axis, the counts, the transform from one
# tensor's HF layout to ours, dtype) -> the [*counts, ...] array.
Stack = Callable[[str, tuple[int, ...], Callable[[Any], Any], Any], Any]


def stacker_on_host(get: Callable[[str], np.ndarray]) -> Stack:
    """A Stack reading each tensor with `get` and filling one array in place, in `dtype`: one stacked copy held,
    not np.stack's list of parts and then a cast's second copy (a 70B model's stacked MLP weight is tens of GB)."""

    def stack(template: str, counts: tuple[int, ...], transform: Callable, dtype) -> np.ndarray | GroupedArray:
        out = None
        for index in np.ndindex(*counts):
            array = transform(get(fill(template, index)))
            if isinstance(array, GroupedArray):  # kept in its checkpoint's groups: small, stacked from a list
                return stack_grouped([array] + [transform(get(fill(template, i))) for i in
                                                list(np.ndindex(*counts))[1:]], counts)
            if out is None:
                out = np.empty(counts + array.shape, dtype)
            elif array.shape != out.shape[len(counts):]:  # assignment would broadcast a damaged tensor over the row
                raise ValueError(f"{fill(template, index)} has shape {array.shape}, the first one's "
                                 f"{out.shape[len(counts):]}: the checkpoint is damaged or mixes models")
            out[index] = array
            del array  # one tensor's source at a time
        return out

    return stack


def param_builders(cfg: ModelConfig, get: Callable[[str], Any], stack: Stack, dtype
                   ) -> Iterator[tuple[ParamPath, Callable[[], Any]]]:
    """(parameter path, a function making its array in our layout) for every parameter, in loading order.
    `get` reads one tensor by its HF name; `stack` makes a stacked one (the layers', and the experts')."""
    yield ("embed",), lambda: get("model.embed_tokens.weight").astype(dtype)
    yield ("final_norm",), lambda: _norm_gain(cfg)(get("model.norm.weight")).astype(dtype)
    if not cfg.tie_word_embeddings:
        yield ("lm_head",), lambda: get("lm_head.weight").T.astype(dtype)
    for ours, (hf, transform) in _layer_weights(cfg).items():
        yield ("layers", ours), lambda hf=hf, transform=transform: stack(
            f"model.layers.*.{hf}", (cfg.num_layers,), transform, dtype)
    if cfg.num_experts and cfg.architecture in MOE_NAMES:  # one tensor per expert
        block = moe_names(cfg)[0]
        for ours, hf in moe_names(cfg)[1].items():
            # [L, E, in, out]: one expert matrix of every layer
            yield ("layers", ours), lambda hf=hf: stack(
                f"model.layers.*.{block}.experts.*.{hf}.weight", (cfg.num_layers, cfg.num_experts),
                lambda w: w.T, dtype)
    if cfg.layers_differ:  # not a checkpoint tensor: each layer's attention kind, stacked and split like the weights
        yield ("layers", "attn_kind"), lambda: np.asarray(cfg.layer_kinds(), np.int32)


def load_params(cfg: ModelConfig, src: TensorSource, dtype) -> Iterator[tuple[ParamPath, np.ndarray]]:
    """Yield (parameter path, array in our layout) one parameter at a time, so at most one stacked tensor
    is materialised beyond the checkpoint itself."""
    for path, build in param_builders(cfg, src.get, stacker_on_host(src.get), dtype):
        yield path, build()


# Matmul weights that can stay in a checkpoint's quantized blocks (models/layers.Grouped): a mixture's experts too,
# whether the checkpoint stores one tensor per expert (MOE_NAMES) or stacks each layer's (gpt-oss's MXFP4).
BLOCK_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")


MAX_GROUP = 128
# The narrowest group kept: below it the scales (and offsets) cost about what the values save, and a weight with
# as many scales as values is no format the matmul reads. Narrower (an FP8 block over a row of 129 columns leaves
# groups of 1), the weight is dequantized at load instead.
MIN_KEPT_GROUP = 16


def weight_tensors(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our matmul weight -> the HF tensors it is made of (every layer's), for those in BLOCK_WEIGHTS and the
    embedding and LM head."""
    names = {"embed": ["model.embed_tokens.weight"]}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    # A mixture's experts come from the per-expert tensors below, or, where a checkpoint stacks each layer's
    # experts (gpt-oss), from the layer table like any weight.
    experts = ("w_gate", "w_up", "w_down") if cfg.num_experts and cfg.architecture not in STACKED_EXPERTS else ()
    for ours, (hf, _) in _layer_weights(cfg).items():
        if ours in BLOCK_WEIGHTS and ours not in experts:
            names[ours] = [fill(f"model.layers.*.{hf}", (i,)) for i in range(cfg.num_layers)]
    if cfg.num_experts and cfg.architecture in MOE_NAMES:  # [L, E]: every layer's every expert
        block, matrices = moe_names(cfg)
        for ours, hf in matrices.items():
            names[ours] = [fill(f"model.layers.*.{block}.experts.*.{hf}.weight", index)
                           for index in np.ndindex(cfg.num_layers, cfg.num_experts)]
    return names


def keep_blocks(cfg: ModelConfig, source: BlockSource, split: dict[str, int] | None = None
                ) -> tuple[GroupedWeights, TensorSource]:
    """(how each weight is kept, a source presenting those weights' tensors as GroupedArrays in that format):
    a weight whose every tensor is of a kept type, in the storage all of them convert into exactly. The others
    (float tensors, types not kept, a weight mixing both) are dequantized at load as before. `split`: the size
    of one device's share of an axis the mesh splits, by our weight name (runner/weights.py), so that no group
    straddles two devices."""
    formats, by_tensor = {}, {}
    available = source.names()
    for ours, tensors in weight_tensors(cfg).items():
        found = [source.block_format(t) for t in tensors if t in available]
        if len(found) < len(tensors) or None in found:
            continue
        # Groups no wider than the axis they run along in our layout (wo's head_dim), than one device's share of
        # it, nor than MAX_GROUP unless the scales are per output channel: a wider group's scale is repeated over
        # the smaller ones, exact, so any mesh splits the weight in whole groups. Per-channel scales keep one group
        # over the whole contracted axis, what a W8A8 or FP8 GEMM scales by, on a mesh that splits or pads the axis
        # too (the scale is then replicated: models/layers.weight), so the matmul computes as on one device.
        fmt = common_format(found)
        if fmt is None:
            continue
        share = 0 if fmt.channel else (split or {}).get(ours, 0)
        group = math.gcd(fmt.group, _group_axis_size(cfg, ours), share, 0 if fmt.channel else MAX_GROUP)
        if group < MIN_KEPT_GROUP:
            log.warning("%s is dequantized at load (its float weights take several times the memory): its "
                        "checkpoint groups narrow to %d columns here (whole groups on each device of the mesh), too "
                        "few to keep; a mesh with fewer tensor-parallel devices keeps them", ours, group)
            continue
        formats[ours] = dataclasses.replace(fmt, group=group)
        by_tensor |= dict.fromkeys(tensors, formats[ours])
    return formats, KeptBlocks(source, by_tensor)


def _group_axis_size(cfg: ModelConfig, ours: str) -> int:
    """The size of the axis weight `ours` is grouped along in our layout (its last contracted axis)."""
    return {"wo": cfg.head_dim, "w_down": cfg.intermediate_size,
            "shared_down": cfg.shared_expert_size}.get(ours, cfg.hidden_size)


class KeptBlocks:
    """A TensorSource whose tensors in `formats` come as GroupedArrays in their weight's format."""

    def __init__(self, source: BlockSource, formats: dict[str, Grouped]):
        self._source, self._formats = source, formats

    def names(self) -> set[str]:
        return self._source.names()

    def get(self, name: str) -> np.ndarray | GroupedArray:
        if name not in self._formats:
            return self._source.get(name)
        return self._source.get_grouped(name).conform(self._formats[name])
