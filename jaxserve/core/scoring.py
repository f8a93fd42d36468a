"""Scoring text pairs, as vLLM scores them (`LLM.score`, `/score`, `/rerank`):
- with an embedding model, each text is embedded (engine/pooling.py) and a pair's score is the cosine similarity
  of its two embeddings;
- with a cross-encoder (a sequence classifier with one label, loader/heads.py), each pair is one prompt, the
  tokenizer's pair encoding, and its score is the classifier's probability of relevance.
Host side, no jax: the servers import it."""

from __future__ import annotations

import numpy as np

from jaxserve.outputs import ClassificationRequestOutput, EmbeddingRequestOutput
from jaxserve.sampling_params import check_truncate_prompt_tokens


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Which first and second texts each score pairs, as vLLM pairs them: one first text against every second
    text, or as many of each, one to one."""
    if num_first == 0 or num_second == 0:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"text_1 has {num_first} texts and text_2 {num_second}: give text_1 one text (scored "
                         "against each of text_2) or as many as text_2 (scored pairwise)")
    return [(i, i) for i in range(num_first)]


def pair_scores(outs: list[EmbeddingRequestOutput | ClassificationRequestOutput], num_first: int,
                pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's score: a cross-encoder's relevance (its outputs are one a pair), or the cosine similarity of
    two embeddings (its outputs are one a text: the first texts', then the second's)."""
    if outs and isinstance(outs[0], ClassificationRequestOutput):
        return [out.outputs.probs[0] for out in outs]
    vectors = [out.outputs.embedding for out in outs]
    return [cosine_similarity(vectors[i], vectors[num_first + j]) for i, j in pairs]


def cosine_similarity(a: list[float], b: list[float]) -> float:
    u, v = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))


def as_prompts(given) -> list:
    """One prompt (a str, or a list of token ids) or a list of them -> a list of prompts."""
    one_token_list = isinstance(given, list) and given and all(isinstance(t, int) for t in given)
    return [given] if isinstance(given, str) or one_token_list else list(given)


def cross_encoder_prompts(tokenizer, first: list, second: list, pairs: list[tuple[int, int]],
                          truncate_prompt_tokens: int | None, max_model_len: int, pair_encoding: bool = True
                          ) -> list[list[int]]:
    """A cross-encoder's prompt for each pair, truncated as vLLM truncates one: to `truncate_prompt_tokens`
    (-1: the longest prompt the context holds) by shortening the longer text first and keeping the special
    tokens, so the query survives a long document. Without `pair_encoding` (a causal LM served as a reranker)
    the two texts are joined and encoded as one text, cut at its end, as vLLM encodes them."""
    check_truncate_prompt_tokens(truncate_prompt_tokens)
    limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens  # pooling needs no room after
    if not pair_encoding:
        return [joined_prompt(tokenizer, first[i], second[j])[:limit] for i, j in pairs]
    return [pair_prompt(tokenizer, first[i], second[j], limit) for i, j in pairs]


def joined_prompt(tokenizer, first: str | list[int], second: str | list[int]) -> list[int]:
    if isinstance(first, str) and isinstance(second, str):
        return list(tokenizer(first + second)["input_ids"])
    if isinstance(first, list) and isinstance(second, list):
        return first + second
    raise ValueError("a pair must be two texts or two token-id lists, not one of each")


def pair_prompt(tokenizer, first: str | list[int], second: str | list[int], limit: int | None = None) -> list[int]:
    """Two texts as the tokenizer encodes a pair (its special tokens around and between them, as
    sentence-transformers' CrossEncoder and vLLM build it), or two token-id lists joined; at most `limit` tokens.

    A fast tokenizer's own truncation option is state on the one tokenizer every request thread shares (a call
    that sets it races with any other call), so the pair is truncated here and then given its special tokens."""
    if isinstance(first, list) and isinstance(second, list):
        kept_first, kept_second = _longest_first(first, second, limit)
        return kept_first + kept_second
    if not (isinstance(first, str) and isinstance(second, str)):
        raise ValueError("a pair must be two texts or two token-id lists, not one of each")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer truncates within the call
        truncation = {} if limit is None else {"truncation": "longest_first", "max_length": limit}
        return list(tokenizer(first, second, **truncation)["input_ids"])
    a, b = (backend.encode(text, add_special_tokens=False) for text in (first, second))
    if limit is not None:
        kept_a, kept_b = _longest_first(a.ids, b.ids, limit - backend.num_special_tokens_to_add(True))
        a.truncate(len(kept_a))
        b.truncate(len(kept_b))
    return list(backend.post_process(a, b).ids)


def _longest_first(a: list[int], b: list[int], limit: int | None) -> tuple[list[int], list[int]]:
    """`a` and `b` in at most `limit` tokens together, cut at their ends as the tokenizers library's
    "longest_first" truncation cuts them: the shorter keeps at most half (rounded down; `a` on a tie), the longer
    the rest."""
    if limit is None or len(a) + len(b) <= limit:
        return a, b
    limit = max(limit, 0)
    if len(a) > len(b):
        keep_b = min(len(b), limit // 2)
        return a[: limit - keep_b], b[:keep_b]
    keep_a = min(len(a), limit // 2)
    return a[:keep_a], b[: limit - keep_a]


def check_cross_encoder(classifier) -> None:
    if classifier.num_labels != 1:
        raise ValueError(f"scoring pairs with a classifier needs a cross-encoder (one label, the pair's relevance); "
                         f"this {classifier.architecture} has {classifier.num_labels} labels: classify instead")
