"""Engine logprobs -> the two OpenAI logprobs formats (legacy completions, and chat)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jaxserve.outputs import Logprob, PositionLogprobs, RequestOutput
from jaxserve.server.chat_protocol import ChatLogProb, ChatLogProbs, ChatLogProbsContent
from jaxserve.server.protocol import CompletionLogProbs, PromptLogprob, PromptLogprobs

# JSON has no -inf; vLLM sends this floor instead, and clients treat it as "impossible".
LOGPROB_FLOOR = -9999.0

TokenName = Callable[[int, "Logprob | None"], str]  # a token's name in logprobs, given its engine entry (if any)


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else float(logprob)


def token_namer(decode: Callable[[int], str], as_ids: bool = False) -> TokenName:
    """How logprobs name tokens: by the engine's decoding of each (else `decode`'s), or as vLLM's
    --return-tokens-as-token-ids, "token_id:N", which a client maps back even where a token is no whole UTF-8 text
    (a byte of a multi-byte character)."""
    if as_ids:
        return lambda token_id, entry: f"token_id:{token_id}"

    def text(token_id: int, entry: Logprob | None) -> str:
        return entry.decoded_token if entry is not None and entry.decoded_token is not None else decode(token_id)

    return text


def _top_entries(position: PositionLogprobs, top_n: int) -> list[tuple[int, Logprob]]:
    """The top-N alternatives by rank (the engine's dict may also hold a sampled token ranked lower)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_n]
    return sorted(ranked, key=lambda item: item[1].rank)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], top_n: int,
                        name: TokenName, text_offset: int = 0) -> CompletionLogProbs:
    """Legacy format: parallel lists of tokens, their logprobs, the top-N dicts and character offsets.

    `positions[i]` is None where no logprob exists (the first prompt token when echoing).
    """
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id) if position is not None else None
        token = name(token_id, entry)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        result.token_logprobs.append(_finite(entry.logprob) if entry is not None else None)
        if position is None:
            result.top_logprobs.append(None)
            continue
        top = {name(tid, lp): _finite(lp.logprob) for tid, lp in _top_entries(position, top_n)}
        if entry is not None:
            top.setdefault(token, _finite(entry.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int,
                  name: TokenName) -> ChatLogProbs:
    """Chat format: one entry per generated token with its bytes and its top-N alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id)
        token = name(token_id, entry)
        alternatives = [_chat_logprob(name(tid, lp), lp.logprob)
                        for tid, lp in _top_entries(position, top_n)]
        sampled = _chat_logprob(token, entry.logprob if entry is not None else LOGPROB_FLOOR)
        content.append(ChatLogProbsContent(**sampled.model_dump(), top_logprobs=alternatives))
    return ChatLogProbs(content=content)


def _chat_logprob(token: str, logprob: float) -> ChatLogProb:
    return ChatLogProb(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


def prompt_logprobs_by_id(output: RequestOutput, top_n: int, name: TokenName) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its own entry and the top-N others,
    keyed by token id."""
    positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    result: PromptLogprobs = []
    for token_id, position in zip(output.prompt_token_ids, positions):
        if position is None:
            result.append(None)
            continue
        kept = [(token_id, position[token_id])] if token_id in position else []
        kept += [(tid, lp) for tid, lp in _top_entries(position, top_n) if tid != token_id]
        result.append({str(tid): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=name(tid, lp))
                       for tid, lp in kept})
    return result
