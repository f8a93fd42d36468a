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
token for every row, and a pooling request's sample is never shown. A base model or a classifier does not
generate (`ModelHead.generates`), nor does a model without a real LM head; the engine refuses generation requests
for them.
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


# How a classifier's logits become what it answers with, as transformers' `problem_type` says (vLLM follows it):
# "regression": the logits themselves; "multi_label_classification": a sigmoid per label; otherwise a sigmoid for
# one label (a cross-encoder's relevance) and a softmax over several.
ACTIVATIONS = ("identity", "sigmoid", "softmax", "tanh")
PROBLEM_ACTIVATIONS = {"regression": "identity", "multi_label_classification": "sigmoid",
                       "single_label_classification": None}  # None: by the label count
# sentence-transformers cross-encoders name theirs in config.json (`sentence_transformers.activation_fn`).
ST_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "sigmoid", "Tanh": "tanh", "Softmax": "softmax"}


@dataclass(frozen=True, eq=False)
class Classifier:
    """A sequence classifier's head: `weight` [num_labels, hidden] (float32), the label of each row, and the
    activation its logits go through (ACTIVATIONS)."""

    weight: np.ndarray
    labels: tuple[str, ...]
    architecture: str  # the checkpoint's own, for messages
    activation: str = "softmax"
    # How a scored pair becomes one prompt: the tokenizer's pair encoding (a cross-encoder's separator between),
    # or, for a causal LM served as a reranker (vLLM's use_sep_token false), the two texts joined as one text
    pair_encoding: bool = True

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def probabilities(self, hidden: np.ndarray, activation: bool = True) -> list[float]:
        """What the classifier answers with from the last token's final hidden state [hidden] (`activation`
        False: its logits)."""
        logits = (self.weight @ np.asarray(hidden, np.float32)).astype(np.float64)
        if self.activation == "identity" or not activation:
            return logits.tolist()
        if self.activation == "sigmoid":
            return (1 / (1 + np.exp(-logits))).tolist()
        if self.activation == "tanh":
            return np.tanh(logits).tolist()
        shifted = np.exp(logits - logits.max())
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


def open_head(raw: dict[str, Any], config: ModelConfig, tensors: TensorSource | None, tokenizer=None
              ) -> tuple[ModelConfig, TensorSource | None, ModelHead]:
    """The head the checkpoint whose config.json is `raw` carries, its tensors under the names a causal LM
    uses, and its config with the embeddings tied in wherever it has no LM head. `tensors` None: a dummy load
    (random weights), whose classifier is random too."""
    if tensors is not None and _lacks_model_prefix(tensors):
        tensors = PrefixedSource(tensors)
    arch = (raw.get("architectures") or [""])[0]
    if arch.endswith(CLASSIFIER_SUFFIX):
        classifier = _classifier(raw, config, tensors, arch, tokenizer)
        return _tied(config), tensors, ModelHead(generates=False, classifier=classifier)
    if arch.endswith(BASE_MODEL_SUFFIX):  # a base model is served for pooling, as vLLM serves LlamaModel & co
        return _tied(config), tensors, ModelHead(generates=False)
    if config.tie_word_embeddings or tensors is None or "lm_head.weight" in tensors.names():
        return config, tensors, ModelHead()
    log.warning("%s has no lm_head.weight: serving it for embeddings only", arch)
    return _tied(config), tensors, ModelHead(generates=False)


def _tied(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, tie_word_embeddings=True)


def _lacks_model_prefix(tensors: TensorSource) -> bool:
    names = tensors.names()
    return "model.embed_tokens.weight" not in names and "embed_tokens.weight" in names


def _classifier(raw: dict[str, Any], config: ModelConfig, tensors: TensorSource | None, arch: str, tokenizer
                ) -> Classifier:
    from_tokens = raw.get("classifier_from_token")
    if from_tokens:
        weight, labels = _head_from_tokens(raw, from_tokens, config, tensors, tokenizer)
        return Classifier(weight, labels, arch, _activation(raw, len(labels)),
                          pair_encoding=bool(raw.get("use_sep_token", False)))
    if tensors is None:  # a dummy load: random, as the rest
        weight = _random_rows(_num_labels(raw), config)
    elif CLASSIFIER_WEIGHT in tensors.names():
        weight = tensors.get(CLASSIFIER_WEIGHT)
    else:
        raise ValueError(f"this {arch} checkpoint has no {CLASSIFIER_WEIGHT} (its classification head); a causal "
                         "LM served as one names the tokens its head reads (hf_overrides' classifier_from_token)")
    if tensors is not None and "score.bias" in tensors.names():
        raise ValueError(f"this {arch} checkpoint's classification head has a bias (score.bias), which jaxserve "
                         "does not apply; the Llama, Qwen, Mistral and Gemma classifiers have none")
    if weight.ndim != 2 or weight.shape[1] != config.hidden_size:
        raise ValueError(f"{CLASSIFIER_WEIGHT} has shape {tuple(weight.shape)}; a classification head is "
                         f"[num_labels, {config.hidden_size}] (hidden_size)")
    labels = _labels(raw, weight.shape[0])
    return Classifier(np.asarray(weight, np.float32), labels, arch, _activation(raw, len(labels)),
                      pair_encoding=bool(raw.get("use_sep_token", True)))


def _head_from_tokens(raw: dict[str, Any], tokens: list[str], config: ModelConfig, tensors: TensorSource | None,
                      tokenizer) -> tuple[np.ndarray, tuple[str, ...]]:
    """A causal LM served as a classifier, as vLLM serves one (`classifier_from_token` in hf_overrides): its head
    is the LM head's rows of the named tokens, one label each; `is_original_qwen3_reranker` (or method
    "from_2_way_softmax") with two tokens [no, yes] makes one label, the yes row minus the no row, whose sigmoid is
    the two-way softmax's probability of yes (how Qwen3-Reranker scores)."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    for token, token_id in zip(tokens, ids):
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this model's tokenizer")
    if tensors is None:  # a dummy load
        rows = _random_rows(len(ids), config)
    else:
        lm_head = "lm_head.weight" if "lm_head.weight" in tensors.names() else "model.embed_tokens.weight"
        rows = np.asarray(tensors.get(lm_head)[ids], np.float32)
    if not (raw.get("is_original_qwen3_reranker") or raw.get("method") == "from_2_way_softmax"):
        return rows.astype(np.float32), tuple(tokens)
    if len(tokens) != 2:
        raise ValueError(f"a two-way softmax head reads two tokens (no, yes), got classifier_from_token={tokens!r}")
    return (rows[1:2] - rows[0:1]).astype(np.float32), (tokens[1],)


def _random_rows(count: int, config: ModelConfig) -> np.ndarray:
    """A dummy load's classification head (the rest of its weights are random too)."""
    return np.random.default_rng(0).normal(0, 0.02, (count, config.hidden_size)).astype(np.float32)


def _num_labels(raw: dict[str, Any]) -> int:
    return int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)


def _labels(raw: dict[str, Any], count: int) -> tuple[str, ...]:
    """The label of each of the head's `count` rows, from config.json's id2label (transformers' default names
    where it has none)."""
    id2label = raw.get("id2label") or {}
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _activation(raw: dict[str, Any], num_labels: int) -> str:
    """As vLLM chooses it: the config's problem_type first, then the activation a sentence-transformers
    cross-encoder names (its `activation_fn`, or the older `sbert_ce_default_activation_function`), else a sigmoid
    for one label and a softmax for more."""
    by_count = "sigmoid" if num_labels == 1 else "softmax"
    if raw.get("problem_type") in PROBLEM_ACTIVATIONS:
        return PROBLEM_ACTIVATIONS[raw["problem_type"]] or by_count
    named = (raw.get("sentence_transformers") or {}).get("activation_fn") or \
        raw.get("sbert_ce_default_activation_function")
    if not named:
        return by_count
    if str(named).rsplit(".", 1)[-1] not in ST_ACTIVATIONS:
        raise ValueError(f"the classifier's activation {named} is not one jaxserve applies; supported: "
                         f"{', '.join(ST_ACTIVATIONS)} (torch.nn's)")
    return ST_ACTIVATIONS[str(named).rsplit(".", 1)[-1]]


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
