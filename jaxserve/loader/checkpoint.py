"""Resolve what the user named (nothing, a GGUF file, an HF directory, an HF hub id) into a config, a tensor
source, a tokenizer and generation defaults."""

from __future__ import annotations

import errno
import json
import logging
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.loader.compressed_tensors import (
    compressed_tensors_source,
    is_compressed_tensors,
    quantization_config,
    weight_scheme,
)
from jaxserve.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from jaxserve.loader.fused import FUSED_ARCHITECTURES, SplitFusedSource
from jaxserve.loader.generation_config import sampling_defaults
from jaxserve.loader.gguf import GGUFFile
from jaxserve.loader.gptq import PackedIntSource, packed_int_method
from jaxserve.loader.heads import ModelHead, causal_config, open_head
from jaxserve.loader.hf_config import model_config_from_hf
from jaxserve.loader.model_name import is_gguf_file, served_name
from jaxserve.loader.mxfp4 import ARCHITECTURES as MXFP4_ARCHITECTURES
from jaxserve.loader.mxfp4 import is_mxfp4, mxfp4_source
from jaxserve.loader.orbax_checkpoint import is_orbax_checkpoint, open_orbax_checkpoint
from jaxserve.loader.pooling import declared_pooling
from jaxserve.loader.random_weights import RandomWeights
from jaxserve.loader.safetensors import SafetensorsSource
from jaxserve.loader.scaled import ScaledSource, fp8_scale_suffix
from jaxserve.loader.text_model import text_model_config, text_model_tensors
from jaxserve.loader.tokenizer import TokenizerChoice, load_tokenizer
from jaxserve.loader.weights import TensorSource

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    name: str
    config: ModelConfig
    tensors: TensorSource
    tokenizer: Any
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    pooling: str | None = None  # what its sentence-transformers config declares (loader/pooling.py)
    head: ModelHead = field(default_factory=ModelHead)  # an LM head, none, or a classifier (loader/heads.py)


LOAD_FORMATS = ("auto", "dummy")


def open_checkpoint(model: str | None, load_format: str = "auto", hf_overrides: dict | None = None,
                    revision: str | None = None, tokenizer: TokenizerChoice = TokenizerChoice(),
                    download_dir: str | None = None) -> Checkpoint:
    """`load_format="dummy"`: the model's config and tokenizer with random weights (loader/random_weights.py);
    an HF model then needs no weight files at all. `hf_overrides`: keys laid over the model's config.json (vLLM's
    hf_overrides: a longer max_position_embeddings, a rope_scaling, ...). `revision`: a hub id's branch, tag or
    commit. `tokenizer`: the model's own tokenizer or another (loader/tokenizer.py). `download_dir`: where a hub
    model is downloaded to (vLLM's download_dir; None: the Hugging Face cache)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {', '.join(map(repr, LOAD_FORMATS))}")
    if hf_overrides is not None and not isinstance(hf_overrides, dict):
        raise ValueError(f"hf_overrides must be a mapping of config.json keys to values, got {hf_overrides!r}")
    ckpt = _open(model, weights=load_format != "dummy", hf_overrides=hf_overrides or {}, revision=revision,
                 tokenizer=tokenizer, download_dir=download_dir)
    if load_format == "dummy":
        ckpt.tensors = RandomWeights(ckpt.config)
    return ckpt


def _open(model: str | None, weights: bool, hf_overrides: dict, revision: str | None,
          tokenizer: TokenizerChoice, download_dir: str | None) -> Checkpoint:
    path = default_model_path() if model is None else Path(model).expanduser()
    local = model is None or path.exists()
    if revision is not None and local:  # ignored, as vLLM and transformers ignore it
        log.warning("revision %r ignored: %s is a local file or directory, not a hub id", revision,
                    model or DEFAULT_MODEL_NAME)
    if tokenizer.given is None and tokenizer.revision is not None and model is not None:
        # vLLM: the model's own tokenizer at that revision, which only a hub id has.
        if local:
            log.warning("tokenizer_revision %r ignored: %s is a local file or directory, not a hub id",
                        tokenizer.revision, model)
        tokenizer = TokenizerChoice() if local else replace(tokenizer, given=model)
    gguf = is_gguf_file(path)
    if hf_overrides and (gguf or (path.is_dir() and is_orbax_checkpoint(path))):
        raise ValueError(f"hf_overrides applies to a Hugging Face config.json, and {model or DEFAULT_MODEL_NAME} "
                         "has none (a GGUF file or a `jaxserve convert` checkpoint): give the HF model directory")
    if model is None or gguf:
        return _open_gguf(path, served_name(model), tokenizer)
    if path.is_file():
        raise ValueError(f"{model} is a file jaxserve cannot serve alone: give a GGUF file, or the Hugging Face "
                         "model directory holding it (config.json beside the .safetensors files)")
    if path.is_dir() and is_orbax_checkpoint(path):
        if not weights:
            raise ValueError(f"{model} is a `jaxserve convert` checkpoint, which load_format='dummy' cannot "
                             "read: give the original model (HF directory, hub id or GGUF file)")
        ckpt = Checkpoint(**open_orbax_checkpoint(path))  # written by `jaxserve convert`, its tokenizer beside the weights
        ckpt.tokenizer = tokenizer.resolve(lambda: ckpt.tokenizer, ckpt.config.vocab_size)
        return ckpt
    if path.is_dir():
        return _open_hf_dir(path, model, weights, hf_overrides, tokenizer)
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(
            f"model path {model!r} does not exist: give a GGUF file, a Hugging Face model directory or a hub id"
        )
    return _open_hf_dir(_download_from_hub(model, weights, revision, download_dir), model, weights, hf_overrides,
                        tokenizer)


def _open_gguf(path: Path, name: str, tokenizer: TokenizerChoice) -> Checkpoint:
    f = GGUFFile(path)
    config = f.model_config()
    return Checkpoint(name=name, config=config, tensors=_split_fused(f, config),
                      tokenizer=tokenizer.resolve(f.tokenizer, config.vocab_size))


def _split_fused(tensors: TensorSource, config: ModelConfig) -> TensorSource:
    return SplitFusedSource(tensors, config) if config.architecture in FUSED_ARCHITECTURES else tensors


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json with vLLM's hf_overrides laid over it: each key's value replaces the file's, except that a
    nested config (`text_config` of a multimodal checkpoint) is updated key by key."""
    merged = dict(raw)
    for key, value in overrides.items():
        nested = key.endswith("_config") and isinstance(value, dict) and isinstance(raw.get(key), dict)
        merged[key] = {**raw[key], **value} if nested else value
    return merged


def _open_hf_dir(directory: Path, name: str, weights: bool = True, hf_overrides: dict | None = None,
                 tokenizer_choice: TokenizerChoice = TokenizerChoice()) -> Checkpoint:
    config_path = directory / "config.json"
    if not config_path.exists():
        ggufs = sorted(directory.glob("*.gguf"))
        hint = f"; to serve its GGUF file, give the file's path ({ggufs[0]})" if ggufs else ""
        raise FileNotFoundError(f"{directory} has no config.json; it is not a Hugging Face model directory{hint}")
    gen_path = directory / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    raw = with_overrides(_read_json(config_path), hf_overrides or {})
    if weights:  # random weights need none of the file's
        refuse_quantized(raw, config_path)
    try:
        config = model_config_from_hf(causal_config(text_model_config(raw)), generation)
    except (KeyError, TypeError, AttributeError) as exc:  # a key missing or of the wrong shape
        given = f" with hf_overrides {hf_overrides!r}" if hf_overrides else ""
        problem = f"lacks {exc}" if isinstance(exc, KeyError) else f"has a value of the wrong shape ({exc})"
        raise ValueError(f"{config_path}{given} {problem}: it is not a config jaxserve can serve") from None
    except ValueError as exc:
        if not hf_overrides:
            raise
        raise ValueError(f"config.json with hf_overrides {hf_overrides!r} is not a config jaxserve can "
                         f"serve ({exc})") from None
    tensors = text_model_tensors(raw, _weights_source(directory, raw)) if weights else None
    # A repository that ships its weights alone has no tokenizer files: say how to give one.
    own = partial(load_tokenizer, directory, advice="if the model ships its weights alone, give its tokenizer "
                                                    "with --tokenizer DIR|HUB_ID")
    tokenizer = tokenizer_choice.resolve(own, config.vocab_size)
    config, tensors, head = open_head(raw, config, tensors, tokenizer)
    tensors = None if tensors is None else _split_fused(tensors, config)
    if tensors is not None and is_mxfp4(raw):
        tensors = mxfp4_source(tensors, config)
    defaults = sampling_defaults(generation, gen_path)
    return Checkpoint(name=name, config=config, tensors=tensors, tokenizer=tokenizer, generation_defaults=defaults,
                      pooling=declared_pooling(directory), head=head)


def _weights_source(directory: Path, raw: dict[str, Any]) -> TensorSource:
    """The safetensors files; a quantized checkpoint's weights presented under their float names (and kept in
    their blocks where the engine says: runner/weights.py)."""
    source = SafetensorsSource(directory)
    if is_compressed_tensors(raw):
        return compressed_tensors_source(source, raw)
    config = quantization_config(raw)
    if suffix := fp8_scale_suffix(config):
        block = config.get("weight_block_size")
        return ScaledSource(source, suffix, "fp8", tuple(block) if block else None)
    if packed_int_method(config):
        return PackedIntSource(source, config)
    if not config:
        refuse_undeclared_quantization(directory, source.names())
    return source


# Tensors only a quantized checkpoint holds (scales, packed values): beside a config that declares no
# quantization, the weights would be read as floats without their scales, every one of them wrong.
QUANTIZED_TENSOR_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_packed", ".qweight", ".qzeros")


def refuse_undeclared_quantization(directory: Path, names: set[str]) -> None:
    """A ValueError for a checkpoint that holds quantized tensors although its config.json declares no
    quantization (NVIDIA ModelOpt's exports declare theirs in hf_quant_config.json)."""
    if (directory / "hf_quant_config.json").exists():
        raise ValueError(f"{directory} is an NVIDIA ModelOpt checkpoint (hf_quant_config.json), whose quantized "
                         "weights jaxserve cannot read yet: serve the unquantized model (and --quantization fp8 "
                         "to quantize it here)")
    quantized = sorted(n for n in names if n.endswith(QUANTIZED_TENSOR_SUFFIXES))
    if quantized:
        raise ValueError(f"{directory} holds quantized tensors ({quantized[0]}, ...) but its config.json declares no "
                         "quantization_config: its weights cannot be read without knowing their format; give the "
                         "checkpoint's own config.json")


def refuse_quantized(raw: dict[str, Any], config_path: Path) -> None:
    """A checkpoint quantized ahead of time (FP8, GPTQ, AWQ, bitsandbytes...) stores weights jaxserve does not read:
    say so, rather than fail on a tensor's dtype or a missing weight later."""
    method = quantization_config(raw)
    if is_mxfp4(raw) and (raw.get("architectures") or [None])[0] in MXFP4_ARCHITECTURES:
        return  # read, dequantized at load (loader/mxfp4.py)
    try:
        if is_compressed_tensors(raw):
            weight_scheme(raw)  # W4A16, W8A16, W8A8, FP8: read (loader/compressed_tensors.py)
            return
        if fp8_scale_suffix(method):
            return  # FP8 by block, channel or tensor (loader/scaled.py)
        if packed_int_method(method):
            return  # GPTQ, AWQ (loader/gptq.py)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    if method:
        name = method.get("quant_method", "quantized") if isinstance(method, dict) else "quantized"
        raise ValueError(f"{config_path} describes a {name} checkpoint, whose weights jaxserve cannot read: serve "
                         "the unquantized model (and --quantization int8 or w8a8 to quantize it here); "
                         "compressed-tensors (W4A16, W8A16, W8A8, FP8), fp8, GPTQ, AWQ and gpt-oss's MXFP4 checkpoints "
                         "are read")


def _download_from_hub(repo_id: str, weights: bool = True, revision: str | None = None,
                       download_dir: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "tokenizer*", "*.model", "*.jinja", "*.txt"] + (["*.safetensors"] if weights else [])
    try:
        # consolidated*.safetensors: Mistral's own format, the same weights again beside the HF shards
        return Path(snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=["consolidated*"],
                                      revision=revision, cache_dir=download_dir))
    except Exception as e:
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:  # a full disk, an unwritable cache: not the id
            raise OSError(f"could not store {repo_id!r} under {download_dir or 'the Hugging Face cache'}: "
                          f"{e.strerror or e}; free space there or pass --download-dir DIR") from None
        # Offline, an unknown repo or revision, a gated repo: all end the same way for the user.
        at = "" if revision is None else f" at revision {revision!r}"
        raise FileNotFoundError(
            f"could not fetch {repo_id!r}{at} from the Hugging Face hub ({type(e).__name__}); "
            "check the id, the revision and network access, or pass a local model directory or GGUF file"
        ) from None


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS}
