"""What a checkpoint's final hidden state feeds: an LM head, nothing, or a classifier.

Three kinds of Hugging Face checkpoint hold a decoder without a usable LM head:
- a base model saved by transformers' `AutoModel` (`MistralModel`: e5-mistral; `Qwen3Model`): no LM head, and
  its tensors lack the "model." prefix. Qwen3-Embedding's files are saved that way under a `Qwen3ForCausalLM`
  config, so the prefix is added wherever it is missing, whatever the config says;
- a causal LM config whose files have no `lm_head.weight` although it is not tied (Qwen3-Embedding-8B);
- a sequence classifier (`LlamaForSequenceClassification`, `Qwen3ForSequenceClassification`, ...: cross-encoder
  rerankers and text classifiers): the decoder plus a `score` matrix [num_labels, hidden] applied at the last
  token.

Each runs as its decoder's causal-LM architecture with the embeddings tied in as the LM head: the step samples a
token for every row, and a pooling request's sample is never shown. A model without a real LM head does not
generate (`ModelHead.generates`); the engine refuses generation requests for it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.weights import TensorSource

log = logging.getLogger(__name__)

CLASSIFIER_SUFFIX = "ForSequenceClassification"
BASE_MODEL_SUFFIX = "Model"
CLASSIFIER_WEIGHT = "score.weight"
HEAD_WEIGHTS = ("lm_head.weight", CLASSIFIER_WEIGHT)  # outside the decoder: never under its "model." prefix


@dataclass(frozen=True)
class Classifier:
    """A sequence classifier's head: `weight` [num_labels, hidden] (float32) and the label of each row."""

    weight: np.ndarray
    labels: tuple[str, ...]
    architecture: str  # the checkpoint's own, for messages

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def probabilities(self, hidden: np.ndarray) -> list[float]:
        """The class probabilities from the last token's final hidden state [hidden], as vLLM's classifier pooler
        gives them: a sigmoid for a single label (a cross-encoder's relevance), else a softmax."""
        logits = self.weight @ np.asarray(hidden, np.float32)
        if self.num_labels == 1:
            return (1 / (1 + np.exp(-logits.astype(np.float64)))).tolist()
        shifted = np.exp(logits.astype(np.float64) - logits.max())
        return (shifted / shifted.sum()).tolist()


@dataclass(frozen=True)
class ModelHead:
    generates: bool = True
    classifier: Classifier | None = None


def causal_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json of a base model or sequence classifier -> the same under its decoder's causal-LM architecture
    (what the model registry knows); any other config passes through."""
    from jaxserve.models.registry import ARCHITECTURES

    arch = (raw.get("architectures") or [None])[0]
    for suffix in (CLASSIFIER_SUFFIX, BASE_MODEL_SUFFIX):
        if isinstance(arch, str) and arch.endswith(suffix):
            causal = arch[: -len(suffix)] + "ForCausalLM"
            if causal in ARCHITECTURES:
                return raw | {"architectures": [causal]}
    return raw


def open_head(raw: dict[str, Any], config: ModelConfig, tensors: TensorSource | None
              ) -> tuple[ModelConfig, TensorSource | None, ModelHead]:
    """The head the checkpoint whose config.json is `raw` carries, its tensors under the names a causal LM
    uses, and its config with the embeddings tied in wherever it has no LM head. `tensors` None: a dummy load
    (random weights), whose classifier is random too."""
    if tensors is not None and _lacks_model_prefix(tensors):
        tensors = PrefixedSource(tensors)
    arch = (raw.get("architectures") or [""])[0]
    if arch.endswith(CLASSIFIER_SUFFIX):
        classifier = _classifier(raw, config, tensors, arch)
        return _tied(config), tensors, ModelHead(generates=False, classifier=classifier)
    if config.tie_word_embeddings or tensors is None or "lm_head.weight" in tensors.names():
        return config, tensors, ModelHead()
    log.warning("%s has no lm_head.weight: serving it for embeddings only", arch)
    return _tied(config), tensors, ModelHead(generates=False)


def _tied(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, tie_word_embeddings=True)


def _lacks_model_prefix(tensors: TensorSource) -> bool:
    names = tensors.names()
    return "model.embed_tokens.weight" not in names and "embed_tokens.weight" in names


def _classifier(raw: dict[str, Any], config: ModelConfig, tensors: TensorSource | None, arch: str) -> Classifier:
    labels = _labels(raw)
    if tensors is None:
        weight = np.random.default_rng(0).normal(0, 0.02, (len(labels), config.hidden_size))
    elif CLASSIFIER_WEIGHT in tensors.names():
        weight = tensors.get(CLASSIFIER_WEIGHT)
    else:
        raise ValueError(f"this {arch} checkpoint has no {CLASSIFIER_WEIGHT} (its classification head)")
    if weight.shape != (len(labels), config.hidden_size):
        raise ValueError(f"{CLASSIFIER_WEIGHT} has shape {tuple(weight.shape)}, and config.json asks for "
                         f"{(len(labels), config.hidden_size)} ({len(labels)} labels x hidden_size)")
    return Classifier(np.asarray(weight, np.float32), labels, arch)


def _labels(raw: dict[str, Any]) -> tuple[str, ...]:
    """The label of each class, from config.json's id2label (transformers' default names where it has none)."""
    id2label = raw.get("id2label") or {}
    count = int(raw.get("num_labels") or len(id2label) or 2)
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(max(count, len(id2label))))


class PrefixedSource:
    """A base model's tensors ("layers.0...") under the names a causal LM's use ("model.layers.0...")."""

    def __init__(self, source: TensorSource):
        self._source = source
        self._names = {n if n in HEAD_WEIGHTS else "model." + n for n in source.names()}

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        return self._source.get(self._own(name))

    def shape(self, name: str) -> tuple[int, ...]:  # a fused projection's (loader/fused.py)
        return self._source.shape(self._own(name))

    def get_rows(self, name: str, start: int, end: int) -> np.ndarray:
        return self._source.get_rows(self._own(name), start, end)

    @staticmethod
    def _own(name: str) -> str:
        return name if name in HEAD_WEIGHTS else name.removeprefix("model.")
