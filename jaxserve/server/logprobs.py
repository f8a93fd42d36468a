"""Engine logprobs -> the two OpenAI logprobs formats (legacy completions, and chat)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jaxserve.outputs import Logprob, PositionLogprobs
from jaxserve.server.chat_protocol import ChatLogProb, ChatLogProbs, ChatLogProbsContent
from jaxserve.server.protocol import CompletionLogProbs

# JSON has no -inf; vLLM sends this floor instead, and clients treat it as "impossible".
LOGPROB_FLOOR = -9999.0

TokenDecoder = Callable[[int], str]


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else float(logprob)


def _token_text(token_id: int, entry: Logprob | None, decode: TokenDecoder) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id)


def _top_entries(position: PositionLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
    """The top-N alternatives by rank (the engine's dict may also hold a sampled token ranked lower)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda item: item[1].rank)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], top_n: int,
                        decode: TokenDecoder, text_offset: int = 0) -> CompletionLogProbs:
    """Legacy format: parallel lists of tokens, their logprobs, the top-N dicts and character offsets.

    `positions[i]` is None where no logprob exists (the first prompt token when echoing).
    """
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id) if position is not None else None
        token = _token_text(token_id, entry, decode)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        result.token_logprobs.append(_finite(entry.logprob) if entry is not None else None)
        if position is None:
            result.top_logprobs.append(None)
            continue
        top = {_token_text(tid, lp, decode): _finite(lp.logprob) for tid, lp in _top_entries(position, top_n)}
        if entry is not None:
            top.setdefault(token, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int,
                  decode: TokenDecoder) -> ChatLogProbs:
    """Chat format: one entry per generated token with its bytes and its top-N alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id)
        token = _token_text(token_id, entry, decode)
        alternatives = [_chat_logprob(_token_text(tid, lp, decode), lp.logprob)
                        for tid, lp in _top_entries(position, top_n)]
        sampled = _chat_logprob(token, entry.logprob if entry is not None else LOGPROB_FLOOR)
        content.append(ChatLogProbsContent(**sampled.model_dump(), top_logprobs=alternatives))
    return ChatLogProbs(content=content)


def _chat_logprob(token: str, logprob: float) -> ChatLogProb:
    return ChatLogProb(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))
