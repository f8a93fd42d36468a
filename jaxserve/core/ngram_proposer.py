"""Draft tokens for speculative decoding by prompt lookup (pure Python + numpy, no jax).

The last n tokens of a sequence (n from prompt_lookup_max down to prompt_lookup_min) are looked up earlier in
the same sequence, prompt and output alike; the tokens that followed an earlier occurrence are the draft. Text
that repeats its context (quoting, editing, summarising, structured output) drafts well; the target model then
checks every drafted token in one step (core/scheduler.py, runner/plan.py).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    @classmethod
    def for_config(cls, speculative) -> NgramProposer | None:
        """The proposer a SpeculativeConfig asks for; None without one."""
        if speculative is None:
            return None
        return cls(speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens likely to follow token_ids; [] when no n-gram recurs."""
        limit = min(self.k, limit)
        if limit <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows over all but the last token: a match there always has a continuation.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                # The latest occurrence with a whole draft after it (the nearest context is the likeliest to recur;
                # in a loop shorter than the draft, the latest one is followed by less than a draft), else the first.
                whole = starts[starts + n + limit <= len(tokens)]
                follow = int(whole[-1] if whole.size else starts[0]) + n
                return tokens[follow : follow + limit].tolist()
        return []
