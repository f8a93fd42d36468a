"""PEFT LoRA adapter directories -> factors in the layout of models/lora.py, scale folded into B.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (what PEFT's save_pretrained
writes, and what vLLM serves). Only plain LoRA on the decoder's attention and dense MLP projections is read;
anything else an adapter asks for (DoRA, biases, trained embeddings or LM head, per-module ranks) is refused by
name rather than served wrong.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from jaxserve.config import ModelConfig
from jaxserve.models.lora import axis_sizes, lora_targets

# The module part of a tensor name: "<anything>layers.<i>.<module>.lora_<A|B>.weight", where <anything> is the
# language model's (PEFT's "base_model.model.model.", a multimodal model's "...language_model.").
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_PREFIX_OK = re.compile(r"^(?:base_model\.model\.)?(?:model\.(?:language_model\.)?|language_model\.model\.)?layers\.")


# Projections some checkpoints fuse (Phi-3's qkv_proj and gate_up_proj), which PEFT adapts whole: their parts in
# output order, each with its share of the fused output. A part's delta is its rows of B times the shared A.
FUSED_MODULES = {
    "self_attn.qkv_proj": (("wq", lambda c: c.num_heads * c.head_dim), ("wk", lambda c: c.num_kv_heads * c.head_dim),
                           ("wv", lambda c: c.num_kv_heads * c.head_dim)),
    "mlp.gate_up_proj": (("w_gate", lambda c: c.intermediate_size), ("w_up", lambda c: c.intermediate_size)),
}


class LoraAdapterError(ValueError):
    """An adapter directory jaxserve cannot serve, with the reason."""


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, dtype) -> dict[str, np.ndarray]:
    """{our parameter name ("wq_lora_a", ...): array [L, <in>, R] or [L, R, <out>]} for every target of `cfg`,
    zeros where the adapter leaves a weight (or a layer) alone; R = max_rank, the adapter's rank zero-padded."""
    directory = Path(path).expanduser()
    config = _read_config(directory)
    rank, scale = _rank_and_scale(config, directory, max_rank)
    factors = _read_factors(directory, cfg)
    targets = lora_targets(cfg)
    size = axis_sizes(cfg)
    out: dict[str, np.ndarray] = {}
    for name, (ins, outs, _) in targets.items():
        a = np.zeros((cfg.num_layers, *(size[x] for x in ins), max_rank), dtype)
        b = np.zeros((cfg.num_layers, max_rank, *(size[x] for x in outs)), dtype)
        for layer, (a_hf, b_hf) in factors.get(name, {}).items():
            _check_factor_shapes(directory, name, layer, a_hf, b_hf, rank, a[layer], b[layer])
            a[layer, ..., :rank] = a_hf.T.reshape(a.shape[1:-1] + (rank,))  # HF A [r, in] -> [<in>, r]
            b[layer, :rank] = (b_hf.T * scale).reshape((rank,) + b.shape[2:])  # HF B [out, r] -> [r, <out>]
        out[f"{name}_lora_a"], out[f"{name}_lora_b"] = a, b
    return out


# PEFT's LoraConfig defaults, which a config that leaves a field out means
PEFT_DEFAULT_RANK, PEFT_DEFAULT_ALPHA = 8, 8
# init_lora_weights values that only set the adapter's starting weights: a saved adapter is a plain LoRA
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def _read_config(directory: Path) -> dict:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoraAdapterError(f"{directory} has no adapter_config.json; a LoRA adapter is a PEFT adapter directory "
                               "(adapter_config.json + adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise LoraAdapterError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_path} holds a JSON {type(config).__name__}, not PEFT's adapter config object")
    init = config.get("init_lora_weights", True)
    refusals = {
        "peft_type": (config.get("peft_type", "LORA") != "LORA", "only LoRA adapters are supported"),
        "use_dora": (config.get("use_dora"), "DoRA adapters are not supported"),
        "bias": (config.get("bias", "none") != "none" or config.get("lora_bias"), "adapters with biases are not supported"),
        "modules_to_save": (config.get("modules_to_save"), "adapters that train whole modules (embeddings, LM head, "
                            "a classification head) are not supported"),
        "rank_pattern": (config.get("rank_pattern") or config.get("alpha_pattern"),
                         "per-module ranks or alphas are not supported"),
        "fan_in_fan_out": (config.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2 Conv1D) adapters are not supported"),
        # These change the base weights when PEFT loads the adapter: served on the unchanged base they are wrong
        "init_lora_weights": (isinstance(init, str) and init.lower() not in PLAIN_INITS,
                              "this initialization modifies the base model's weights when PEFT loads the adapter "
                              "(PiSSA, OLoRA, CorDA, LoftQ); convert it to a plain LoRA adapter with PEFT's "
                              "path_initial_model_for_weight_conversion"),
        "alora_invocation_tokens": (config.get("alora_invocation_tokens"),
                                    "activated LoRA (applied only from its invocation tokens on) is not supported"),
        "use_qalora": (config.get("use_qalora"), "QA-LoRA adapters are not supported"),
        "layer_replication": (config.get("layer_replication"), "adapters that replicate layers are not supported"),
        "use_bdlora": (config.get("use_bdlora"), "block-diagonal LoRA adapters are not supported"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise LoraAdapterError(f"{directory}: {why} ({key}={config.get(key)!r} in adapter_config.json)")
    return config


def _rank_and_scale(config: dict, directory: Path, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r", PEFT_DEFAULT_RANK), config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraAdapterError(f"{directory}: r={rank!r} in adapter_config.json; a LoRA rank is a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraAdapterError(f"{directory}: lora_alpha={alpha!r} in adapter_config.json; it is a number")
    if rank > max_rank:
        raise LoraAdapterError(f"{directory} has rank {rank}, above max_lora_rank={max_rank}; start the engine with "
                               f"max_lora_rank >= {rank} (--max-lora-rank {rank})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def _read_factors(directory: Path, cfg: ModelConfig) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """{our weight name: {layer: (HF A [r, in], HF B [out, r])}} from the adapter's tensors."""
    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        found = "adapter_model.bin" if (directory / "adapter_model.bin").exists() else "no adapter_model.safetensors"
        raise LoraAdapterError(f"{directory} has {found}; jaxserve reads adapter_model.safetensors (save the adapter "
                               "with PEFT's save_pretrained(safe_serialization=True))")
    ours = {hf: name for name, (_, _, hf) in lora_targets(cfg).items()}
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    try:
        tensors = load_file(str(file))
    except SafetensorError as e:
        raise LoraAdapterError(f"{file} is not a readable safetensors file ({e})") from None
    fusable = {hf: parts for hf, parts in FUSED_MODULES.items() if {name for name, _ in parts} <= set(ours.values())}
    for tensor_name, array in tensors.items():
        m = _TENSOR.match(tensor_name)
        module = m.group(2) if m is not None else None
        fused = fusable.get(module, ())
        if m is None or not _PREFIX_OK.match(tensor_name) or not (module in ours or fused):
            supported = ", ".join(hf.split(".")[-1] for hf in [*ours, *fusable])
            raise LoraAdapterError(f"{directory}: tensor {tensor_name!r} adapts a module jaxserve cannot adapt for "
                                   f"{cfg.architecture} (supported target modules: {supported})")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraAdapterError(f"{directory}: tensor {tensor_name!r} is for layer {layer}, but the model has "
                                   f"{cfg.num_layers} layers: the adapter was trained for another model")
        array = array.astype(np.float32)
        if not fused:
            pairs.setdefault((ours[module], layer), {})[m.group(3)] = array
            continue
        widths = [width(cfg) for _, width in fused]
        if m.group(3) == "B" and array.shape[0] != sum(widths):
            raise LoraAdapterError(f"{directory}: layer {layer}'s {module} lora_B has {array.shape[0]} rows, but "
                                   f"this model's {module} has {sum(widths)}: the adapter was trained for another "
                                   "model")
        parts = np.split(array, np.cumsum(widths)[:-1]) if m.group(3) == "B" else [array] * len(fused)
        for (name, _), part in zip(fused, parts):
            pairs.setdefault((name, layer), {})[m.group(3)] = part
    factors: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for (name, layer), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"{directory}: layer {layer}'s {name} has lora_{''.join(ab)} without its pair")
        factors.setdefault(name, {})[layer] = (ab["A"], ab["B"])
    return factors


def _check_factor_shapes(directory: Path, name: str, layer: int, a_hf: np.ndarray, b_hf: np.ndarray, rank: int,
                         a_ours: np.ndarray, b_ours: np.ndarray) -> None:
    want_a = (rank, int(np.prod(a_ours.shape[:-1])))
    want_b = (int(np.prod(b_ours.shape[1:])), rank)
    if a_hf.shape != want_a or b_hf.shape != want_b:
        raise LoraAdapterError(f"{directory}: layer {layer}'s {name} factors are {a_hf.shape} and {b_hf.shape}, but "
                               f"rank {rank} on this model needs {want_a} and {want_b}: the adapter was trained "
                               "for another model")
