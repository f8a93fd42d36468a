"""The language model inside a multimodal checkpoint (Gemma 3 4B/12B/27B: `Gemma3ForConditionalGeneration`),
served text-only: its config is the nested `text_config` and its tensors sit under a prefix of their own.

Images are not supported; the vision tower and projector are never read.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxserve.loader.weights import TensorSource

log = logging.getLogger(__name__)

# Multimodal architecture -> the text-only architecture its language model is.
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Where checkpoints keep the language model's "model." tensors: the hub's original files, then transformers 5's.
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")


def _multimodal_architecture(d: dict[str, Any]) -> str | None:
    arch = (d.get("architectures") or [None])[0]
    return arch if arch in TEXT_MODELS else None


def text_model_config(d: dict[str, Any]) -> dict[str, Any]:
    """config.json of a multimodal checkpoint -> its language model's config, with transformers' defaults for
    every field the (often sparse) `text_config` leaves out. Any other config passes through."""
    arch = _multimodal_architecture(d)
    if arch is None:
        return d
    from transformers import AutoConfig

    text = dict(d.get("text_config") or {})
    model_type = text.pop("model_type", "gemma3_text")
    full = AutoConfig.for_model(model_type, **text).to_dict()
    for key in ("eos_token_id", "bos_token_id"):  # the top level carries the chat's end-of-turn ids
        if d.get(key) is not None:
            full[key] = d[key]
    log.warning("%s: serving its language model only (%s); image inputs are not supported", arch, TEXT_MODELS[arch])
    return full | {"architectures": [TEXT_MODELS[arch]]}


def text_model_tensors(d: dict[str, Any], source: TensorSource) -> TensorSource:
    """The language model's tensors of the multimodal checkpoint whose config.json is `d`; any other checkpoint's
    tensors pass through."""
    return TextModelSource(source) if _multimodal_architecture(d) else source


class TextModelSource:
    """The language model's tensors under the names a text-only checkpoint uses ("model.layers.0...")."""

    def __init__(self, source: TensorSource):
        self._source = source
        names = source.names()
        self._prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in names), None)
        if self._prefix is None:
            raise ValueError(f"this multimodal checkpoint has no language model under {' or '.join(TEXT_PREFIXES)}")
        self._names = {"model." + n[len(self._prefix):] for n in names if n.startswith(self._prefix)}

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if not name.startswith("model."):
            raise ValueError(f"tensor {name!r} is not part of the language model")
        return self._source.get(self._prefix + name[len("model."):])
