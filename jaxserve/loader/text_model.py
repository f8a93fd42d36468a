"""The language model inside a multimodal checkpoint (Gemma 3 4B/12B/27B: `Gemma3ForConditionalGeneration`;
Mistral Small 3.1/3.2: `Mistral3ForConditionalGeneration`), served text-only: its config is the nested
`text_config` and its tensors sit under a prefix of their own.

Images are not supported; the vision tower and projector are never read.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxserve.loader.weights import RenamingSource, TensorSource

log = logging.getLogger(__name__)

# Multimodal architecture -> the text-only architecture its language model is, and the `model_type` its
# text_config has when it does not say.
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
               "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral")}
# Where checkpoints keep the language model's "model." tensors: the hub's original files, then transformers 5's.
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
# ... and its LM head, when the embeddings are not tied.
LM_HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight")


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

    text_arch, default_type = TEXT_MODELS[arch]
    text = dict(d.get("text_config") or {})
    model_type = text.pop("model_type", default_type)
    full = AutoConfig.for_model(model_type, **text).to_dict()
    # The top level carries the chat's end-of-turn ids, and says whether transformers ties the LM head.
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            full[key] = d[key]
    log.warning("%s: serving its language model only (%s); image inputs are not supported", arch, text_arch)
    return full | {"architectures": [text_arch]}


def text_model_tensors(d: dict[str, Any], source: TensorSource) -> TensorSource:
    """The language model's tensors of the multimodal checkpoint whose config.json is `d`; any other checkpoint's
    tensors pass through."""
    return TextModelSource(source) if _multimodal_architecture(d) else source


class TextModelSource(RenamingSource):
    """The language model's tensors under the names a text-only checkpoint uses ("model.layers.0...")."""

    def __init__(self, source: TensorSource):
        self._source = source
        names = source.names()
        self._prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in names), None)
        if self._prefix is None:
            raise ValueError(f"this multimodal checkpoint has no language model under {' or '.join(TEXT_PREFIXES)}")
        self._names = {"model." + n[len(self._prefix):] for n in names if n.startswith(self._prefix)}
        self._lm_head = next((n for n in LM_HEAD_NAMES if n in names), None)
        if self._lm_head is not None:
            self._names.add("lm_head.weight")

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        return self._source.get(self._source_name(name))

    def _source_name(self, name: str) -> str:
        if name == "lm_head.weight" and self._lm_head is not None:
            return self._lm_head
        if not name.startswith("model."):
            raise ValueError(f"tensor {name!r} is not part of the language model")
        return self._prefix + name[len("model."):]

    # A quantized checkpoint's language model keeps its groups (loader/weights.BlockSource), renamed the same way.
    def block_format(self, name: str):
        return self._source.block_format(self._source_name(name))

    def get_grouped(self, name: str):
        return self._source.get_grouped(self._source_name(name))
