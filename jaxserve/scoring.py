"""Scoring text pairs, as vLLM scores them (`LLM.score`, `/score`, `/rerank`):
- with an embedding model, each text is embedded (engine_pooling.py) and a pair's score is the cosine similarity
  of its two embeddings;
- with a cross-encoder (a sequence classifier with one label, loader/heads.py), each pair is one prompt, the
  tokenizer's pair encoding, and its score is the classifier's probability of relevance.
Host side, no jax: the servers import it."""

from __future__ import annotations

import numpy as np

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


def cosine_similarity(a: list[float], b: list[float]) -> float:
    u, v = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))


def as_prompts(given) -> list:
    """One prompt (a str, or a list of token ids) or a list of them -> a list of prompts."""
    one_token_list = isinstance(given, list) and given and all(isinstance(t, int) for t in given)
    return [given] if isinstance(given, str) or one_token_list else list(given)


def cross_encoder_prompts(tokenizer, first: list, second: list, pairs: list[tuple[int, int]],
                          truncate_prompt_tokens: int | None, max_model_len: int) -> list[list[int]]:
    """A cross-encoder's prompt for each pair, truncated as vLLM truncates one: to `truncate_prompt_tokens`
    (-1: max_model_len) by the tokenizer's own pair truncation, which shortens the longer text first and keeps
    the special tokens, so the query survives a long document."""
    check_truncate_prompt_tokens(truncate_prompt_tokens)
    limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return [pair_prompt(tokenizer, first[i], second[j], limit) for i, j in pairs]


def pair_prompt(tokenizer, first: str | list[int], second: str | list[int], limit: int | None = None) -> list[int]:
    """Two texts as the tokenizer encodes a pair (its special tokens around and between them, as
    sentence-transformers' CrossEncoder and vLLM build it), or two token-id lists joined (their last `limit`)."""
    if isinstance(first, str) and isinstance(second, str):
        truncation = {} if limit is None else {"truncation": True, "max_length": limit}
        return list(tokenizer(first, second, **truncation)["input_ids"])
    if isinstance(first, list) and isinstance(second, list):
        return (first + second)[-limit:] if limit else first + second
    raise ValueError("a pair must be two texts or two token-id lists, not one of each")


def check_cross_encoder(classifier) -> None:
    if classifier.num_labels != 1:
        raise ValueError(f"scoring pairs with a classifier needs a cross-encoder (one label, the pair's relevance); "
                         f"this {classifier.architecture} has {classifier.num_labels} labels: classify instead")
