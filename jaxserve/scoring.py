"""Scoring text pairs with an embedding model, as vLLM scores them for one (`LLM.score`, `/score`, `/rerank`):
each text is embedded (engine_pooling.py) and a pair's score is the cosine similarity of its two embeddings.
Host side, no jax: the servers import it."""

from __future__ import annotations

import numpy as np


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
